"""The Hugging Face MoE model the plan describes: :mod:`.models` (build, find the MoE blocks,
apply the placement), :mod:`.model_setup` (ready for ``deepspeed.initialize``),
:mod:`.pretrained` + :mod:`.hf_checkpoint` (weights streamed into ZeRO-3 partitions),
:mod:`.grouped_moe` (the grouped-GEMM block), :mod:`.perf` (the plan's speed options),
:mod:`.placement` (the placement check after initialize), :mod:`.export` (the trained model as a
Hugging Face directory). Per-family knowledge is in ``moe_trainer.families``."""
