"""``weights=``: full weights to start from, each rank reading only its stage's tensors (``.pt``,
``.ckpt``, ``.safetensors``, a lightning-pipe checkpoint directory, a ``save_pretrained``
directory); Hugging Face's sharded directories and how file names map onto the module's."""

from lightning_pipe.weights.load import check_weights_argument, load_local, load_stage_weights, model_spec, open_weights

__all__ = ["check_weights_argument", "load_local", "load_stage_weights", "model_spec", "open_weights"]
