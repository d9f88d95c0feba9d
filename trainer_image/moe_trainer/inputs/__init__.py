"""The token data a run reads: :mod:`.data` (tokenizer, token streams, deterministic batches),
:mod:`.prepared` (``moe-prepare-data``'s memory-mapped shards), :mod:`.corpus` (the small
real-text corpus built from what ships with Python)."""
