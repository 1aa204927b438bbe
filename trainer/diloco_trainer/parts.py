"""The public bring-your-own-model module: what a `model.entrypoint` build function imports.

`from diloco_trainer.parts import TrainingParts, Batch, lm_loss` keeps working across releases;
the implementation lives in `diloco_trainer.models.parts` and `diloco_trainer.models.data`.
"""

from diloco_trainer.models.data import Batch, TokenStream
from diloco_trainer.models.parts import TrainingParts, TrainStream, lm_loss

__all__ = ["Batch", "TokenStream", "TrainStream", "TrainingParts", "lm_loss"]
