"""A team's own model and data loader for diloco-operator (see docs/byo.md).

`model.entrypoint: "diloco_byo.build:build"` makes every learner and the syncer call
`diloco_byo.build.build(spec, ...)` instead of building the built-in GPT.
"""
