"""The documents that cross the operator/trainer boundary (docs/contracts.md), in one place.

Both sides import this package and nothing else of each other: the operator (``moejob_operator``)
and the trainer image (``moe_trainer``) read and write every document through it. It needs only
pydantic and numpy (no torch, no kubernetes, no kopf).

- :mod:`.plan`      MoEPlan v1 (planning core -> trainer)
- :mod:`.routing`   RoutingStats v1/v2 and its ConfigMap codec (trainer -> planning core)
- :mod:`.progress`  TrainerProgress v1 (trainer -> operator)
- :mod:`.exit`      TrainerExit v1 (trainer -> operator, termination message)
- :mod:`.topology`  TopologyReport v1 (discovery -> planning core)
- :mod:`.model`     ModelReport v1 (model inspection -> planning core)
- :mod:`.data`      DataPrepReport v1 (data preparation -> operator), DataManifest v1 (-> trainer)
- :mod:`.gate`      SmokePlans v1, SmokeVerdict v3, SmokeGolden v1, GateVerdict v1 (operator <->
                    smoke test)
- :mod:`.dispatch`  the byte model of ``placement.quality.dispatch`` (planner and smoke test)
- :mod:`.env`       the worker pods' environment and the ConfigMap keys
- :mod:`.errors`    DocumentError, the one error type of a bad document
"""
