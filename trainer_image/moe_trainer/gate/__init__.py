"""The upgrade gate's smoke run, ``moe-smoke`` (docs/gate.md): :mod:`.main` (the command: the
phases, their rank processes, the verdict), :mod:`.runner` (one rank: the checks of a phase in
order), :mod:`.checks` (what each check runs through the trainer's own code), :mod:`.numerics`
and :mod:`.reference` (every step against plain PyTorch), :mod:`.compare` (the comparisons and
``tolerances.json``), :mod:`.dispatch` (the bytes the all-to-alls sent against the plan's model),
:mod:`.state` (an engine's state gathered into this rank's view)."""
