"""The GPU validation of issue 17, run by ``benchmarks/gpu_validation.py``.

The plan (:mod:`._steps`) runs each step as a subprocess (:mod:`._runner`) and reports
what they printed (:mod:`._output`, :mod:`._report`) with the machine they ran on
(:mod:`._machine`). The steps that are not pytest re-invoke the script, which runs one of
:mod:`.fairscale_checks`, :mod:`.memory_checks` or a notebook (:mod:`._notebooks`) in
that subprocess. Lightning's ``DDPFullyShardedStrategy`` is covered by the ``gpu``-marked
tests in ``tests/gpu/test_strategies_gpu.py``, which the pytest step runs.

The script imports this package as ``gpu``, from its own directory: FairScale installs a
top-level package named ``benchmarks``, which hides ``benchmarks.gpu``. Only the standard
library is imported at module level; the steps import torch, Lightning, FairScale and
nbclient when they run.
"""
