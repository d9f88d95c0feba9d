"""Fast MoE primitives (token dispatch, grouped GEMMs) used by `moe_trainer.model.grouped_moe`."""
