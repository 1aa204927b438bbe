"""What is trained: the built-in GPT, byte-level corpora and token streams, and `TrainingParts`
(the bring-your-own-model contract, also importable as `diloco_trainer.parts`)."""
