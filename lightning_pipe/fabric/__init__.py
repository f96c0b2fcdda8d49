"""Lightning Fabric over the pipeline: a Fabric strategy whose ``fabric.setup`` splits the model
(:func:`lightning_pipe.build_pipeline`), whose ``train_step`` runs a batch's whole schedule, and whose
``fabric.save``/``fabric.load`` write and read the project's checkpoint directories."""
