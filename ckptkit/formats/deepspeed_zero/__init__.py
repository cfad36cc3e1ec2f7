"""DeepSpeed ZeRO checkpoints (stages 1, 2, 3 and ``BF16_Optimizer``), read from the files alone.

Layout: a tag directory (``global_step2/``) holding ``mp_rank_00_model_states.pt`` (stages 1/2)
or ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (stage 3, one per rank) and
``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``; its parent ("run" directory) names the
newest tag in ``latest``. Either opens; the run directory reads the tag ``latest`` names, records
lying under ``<tag>/``.

Keys (as the model's ``state_dict()`` names them):

* ``model.<name>``: what DeepSpeed's ``zero_to_fp32`` produces, in its order and dtypes:
  buffers (from the model states), frozen parameters (stage >= 2 only: stage 1 saves none),
  the fp32 master weights of the trainable parameters, then tied aliases (``shared_params``)
  with the same chunks as their source. A parameter's chunks are its pieces in the ranks' flat
  fp32 partitions (see :mod:`.geometry`): flat byte ranges of the rank files, the
  padding never exposed.
* ``module.<name>``: the module weights as saved (16-bit when training in bf16/fp16; stages
  1/2 only, since stage 3 saves zero-element placeholders: there only its buffers).
* ``optim.state.<name>.<stat>``: the optimizer state cut the same way (``exp_avg``,
  ``exp_avg_sq``; a group's 0-d ``step`` shown for each of its parameters),
  ``optim.param_groups.<i>.<field>`` and DeepSpeed's own optimizer fields
  (``optim.loss_scaler``, ``optim.zero_stage``…) as objects.
* ``train.<key>``: everything else rank 0's model states hold (``global_steps``,
  ``lr_scheduler``, ``ds_config``, client state…), as objects.

One difference from ``zero_to_fp32``'s state dict: it casts 16-bit *floating buffers* to fp32;
here a buffer keeps the dtype it was saved in (a catalog entry is stored bytes, never
converted). Its command line also casts frozen 16-bit parameters: ``unshard(dtype="float32")``
writes exactly what ``zero_to_fp32.py <dir> <out>`` writes.

Pipeline parallelism (``PipelineModule``: ``layer_XX-model_states.pt`` per layer, one
``mp_rank_{stage}_model_states.pt`` and ZeRO stage-1 partitions per stage) is read too: the layer
files as ``model.<layer>.<param>`` / ``model.tied_modules.<key>.<param>`` (the names of
``PipelineModule.state_dict()``), the fp32 masters as ``optim.fp32.<name>``, see
:mod:`.pipeline`.

Not supported (recognised, refused with an :class:`~ckptkit.errors.UnsupportedLayoutError`
naming it): tensor/model parallelism (``mp_rank_01``… without layer files; pipeline + tensor
parallel: ``layer_XX-model_01-model_states.pt`` or ``tp_degree`` > 1), pipeline without ZeRO
(stage 0: the optimizer pickled in the model states), MoE expert files (``*expp_rank_*`` /
``*expert_*_mp_rank_*``), and ZeRO-Infinity NVMe offload (the swap files it copies to
``<tag>/offloaded_tensors/``).

The package: :mod:`.detection` (tag directories, ``latest``, refused layouts), :mod:`.pickles`
(the stand-ins the safe unpickler uses), :mod:`.state` (the decoded state of one tag, checked),
:mod:`.geometry` (where each parameter lies in the flat partitions), :mod:`.model_states` and
:mod:`.optimizer` (the entries), :mod:`.pipeline` (pipeline-parallel tags), :mod:`.catalog`
(``describe``).
"""

from __future__ import annotations

from .catalog import describe
from .detection import NAME, detect

__all__ = ["NAME", "describe", "detect"]
