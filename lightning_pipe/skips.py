"""Skip connections in a split ``nn.Sequential``, declared as torchgpipe does: ``@skippable(stash=[...],
pop=[...])`` on the layers, :func:`stash` and :func:`pop` in their ``forward``. The mechanism lives in
:mod:`lightning_pipe.runtime.crossing.skips`; this module is the name users import."""

from lightning_pipe.runtime.crossing.skips import pop as pop
from lightning_pipe.runtime.crossing.skips import skippable as skippable
from lightning_pipe.runtime.crossing.skips import stash as stash
