"""What a run measures and reports: :mod:`.routing` (router probes, balancing loss, routing
statistics), :mod:`.token_samples` (sampled token expert sets), :mod:`.commtime` (time and bytes
of the collectives), :mod:`.health` (the per-step health findings), :mod:`.progress` (the
TrainerProgress document, its ConfigMap and metrics), :mod:`.routing_publish` (RoutingStats into
its ConfigMap), :mod:`.heatmap` (the expert-load picture)."""
