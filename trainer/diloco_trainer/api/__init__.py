"""The torch-free contract between the operator, the learners and the syncer.

The job spec (`spec`), the pod environment (`contract`) and the syncer's HTTP protocol
(`protocol`). This is the only part of `diloco_trainer` the operator imports: it needs pydantic,
PyYAML, aiohttp (the client) and the standard library, never torch.
"""
