"""Building the stages: what to split, the stage modules, the ends of a Hugging Face model, meta-built stages and
their initialisation."""
