"""The checkpoint bundle: its files, atomic writes and validating reads (docs/design.md §6).

A bundle is a set of files sharing a stem ``S``; a save's data files carry its tag:

============================= ============================================= ===================
file                          content                                       written by
============================= ============================================= ===================
``S.<tag>.fdl``               parameters + buffers (``torch.save``)         the checkpoint rank
``S.<tag>.rank<N>.optim``     rank ``N``'s optimizer ``state_dict``         rank ``N``
``S.<tag>.outer.fdl``         outer-optimizer momentum                      its owner
``S.meta.json``               epoch, step, ElChe state, coverage, the tag   the coordinator
``S.rank<N>.death.json``      forensic record of a rank that died           the dying rank
============================= ============================================= ===================

Rules:

1. **The meta commits a bundle.** It is written last, atomically, once the save's model file
   is on disk, and names the save's tag: until then the previous meta, and the files of its
   tag, are the resume point. A save killed or failed between any two of its writes leaves the
   previous bundle valid; its orphan files are removed by the next save that commits
   (:func:`remove_superseded`).
2. **Every write is atomic**: temporary file, fsync, rename, directory fsync; a failed write
   leaves no temporary file and raises :class:`~flodl.errors.CheckpointError`
   (:func:`write_death_record` alone is best effort).
3. **Every read validates**: torch files are loaded with ``weights_only=True`` and must carry
   their format tag, a known version and the save's global step; the meta goes through
   :class:`CheckpointMeta`. Whatever is wrong raises :class:`~flodl.errors.CheckpointError`
   whose message starts with the file's path.
4. **The original's layout reads**: a meta without a tag names the untagged files ``S.fdl``…

Any function taking a stem also takes a bundle file's path (:func:`normalize_stem`).
"""

from __future__ import annotations

from flodl.checkpoint.death import (
    DEATH_SCHEMA_VERSION,
    DeathRecord,
    death_records,
    read_death_record,
    write_death_record,
)
from flodl.checkpoint.files import (
    TAG_PATTERN,
    atomic_write_bytes,
    bundle_tag,
    death_path,
    meta_path,
    model_path,
    normalize_stem,
    optim_path,
    outer_path,
    remove_superseded,
)
from flodl.checkpoint.meta import (
    META_SCHEMA_VERSION,
    SAVE_REASONS,
    CheckpointMeta,
    Coverage,
    EpochCoverage,
    commit_bundle,
    covered_samples,
    read_meta,
    resolve_tag,
    resume_state,
    uncovered_samples,
    write_meta,
)
from flodl.checkpoint.torch_files import (
    MODEL_FORMAT,
    OPTIM_FORMAT,
    OUTER_FORMAT,
    ModelBundle,
    OptimBundle,
    OuterBundle,
    load_model,
    load_optim,
    load_outer,
    save_model,
    save_optim,
    save_outer,
)

__all__ = [
    # names
    "TAG_PATTERN",
    "bundle_tag",
    "normalize_stem",
    "model_path",
    "optim_path",
    "meta_path",
    "outer_path",
    "death_path",
    "atomic_write_bytes",
    "remove_superseded",
    # torch files
    "MODEL_FORMAT",
    "ModelBundle",
    "save_model",
    "load_model",
    "OPTIM_FORMAT",
    "OptimBundle",
    "save_optim",
    "load_optim",
    "OUTER_FORMAT",
    "OuterBundle",
    "save_outer",
    "load_outer",
    # S.meta.json
    "META_SCHEMA_VERSION",
    "SAVE_REASONS",
    "EpochCoverage",
    "Coverage",
    "CheckpointMeta",
    "write_meta",
    "commit_bundle",
    "resolve_tag",
    "read_meta",
    "resume_state",
    "uncovered_samples",
    "covered_samples",
    # S.rank<N>.death.json
    "DEATH_SCHEMA_VERSION",
    "DeathRecord",
    "write_death_record",
    "read_death_record",
    "death_records",
]
