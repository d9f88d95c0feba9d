"""Fast MoE primitives (token dispatch, grouped GEMMs) used by `moe_trainer.grouped_moe`."""
