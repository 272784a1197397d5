"""Orbax checkpoints, one module for both trainers: an RL run's (`RunCheckpointer`) and drafter
training's (`DrafterCheckpointer`).

An RL run's checkpoint at step k holds, as three items of one orbax step directory:
- `state`: the `TrainState` pytree (policy params, optimizer state, step, RNG key data);
- `data`: the prompt iterator's position (`{"epoch", "index"}`, JSON);
- `config`: the run's `TrainConfig.to_dict()` (JSON), for the record and for resume checks;
- `weights`: `{"fingerprint": ...}` of the checkpoint file the run's model was loaded from
  (`checkpoints.weights_fingerprint`; absent for a random preset, and in checkpoints written
  before it existed), so a resume can tell a moved checkpoint from other weights, and
  `"tokenizer"`: its tokenizer files' (`checkpoints.tokenizer_fingerprint`), so one edited
  in place is told apart too;
- `extra`: host-side state of the run's other parts (JSON: the SD bandits' reward windows and
  random streams, the online drafter's counters); checkpoints written before it existed
  restore with `extra == {}`;
- `drafter` (runs that train the drafter online): its `DrafterTrainState` (params, optimizer
  state, step); `drafter_buffer`: the recent samples it trains on (flat host arrays), so a
  resumed run trains on what the uninterrupted one would.

Saves are asynchronous (device arrays are copied to host before `save` returns; files are
written in the background) and atomic: orbax writes into a temporary directory and renames it
when every item is complete, so a crash mid-save leaves the previous checkpoint the latest
restorable one; leftover temporary directories are removed when the manager is next opened.

A drafter checkpoint (offline warm-up) holds the `DrafterTrainState` and the drafter's
architecture (JSON), so resuming with another drafter fails loudly; never the policy's
embedding or head.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import drafter_config
from tlt_jax.programs import abstract_like


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `RunCheckpointer.restore` returns."""

    step: int
    state: Any
    data_position: dict[str, int]
    config: dict[str, Any]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    drafter: Any = None
    drafter_buffer: dict[str, np.ndarray] | None = None


def tree_paths(tree: Any) -> dict[str, tuple]:
    """`{path: shape}` of a pytree's array leaves (arrays, `ShapeDtypeStruct`s or orbax's
    array metadata); a path is `keystr(simple=True)` with "/" between the keys, so a dataclass
    or named tuple and the nested dicts orbax stores it as give the same paths."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="/"): tuple(leaf.shape)
            for path, leaf in leaves}  # fmt: skip


class _Checkpointer:
    """What both checkpointers share: one orbax `CheckpointManager` under `directory`."""

    directory: Path
    _manager: ocp.CheckpointManager
    _read_only: bool = False  # a reader of another process's run (`RunCheckpointer`)

    def latest_step(self) -> int | None:
        if self._read_only:  # orbax lists the steps once, when opened: a live run has since
            self._manager.reload()  # saved newer ones and deleted older ones (max_to_keep)
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        if self._read_only:
            self._manager.reload()  # as in `latest_step`
        return list(self._manager.all_steps())

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


class RunCheckpointer(_Checkpointer):
    """Keeps the last `max_to_keep` checkpoints of one run under `directory`."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3,
                 async_save: bool = True, process_local: bool = False,
                 read_only: bool = False):  # fmt: skip
        """
        Args:
          process_local: in a multi-process run whose state is replicated per process (each
            holds the whole state on its own devices), this process reads and writes on its
            own, without orbax's cross-process barriers; the trainer saves from process 0
            only.
          read_only: a reader of another process's run (evaluation, probes): it creates,
            deletes and saves nothing. A writer removes orbax's temporary directories when it
            opens, which are the saves in flight if the run is still training: a reader
            opened that way mid-save destroyed the save and crashed the trainer.
        """
        self.directory = Path(directory).expanduser().absolute()
        self._process_local = process_local
        self._read_only = read_only
        multiprocessing = ocp.options.MultiprocessingOptions()
        if process_local:
            self.directory.mkdir(parents=True, exist_ok=True)  # orbax won't with active_processes
            index = jax.process_index()
            multiprocessing = ocp.options.MultiprocessingOptions(
                primary_host=index, active_processes={index},
                barrier_sync_key_prefix=f"process{index}",
            )  # fmt: skip
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep,
            create=not (process_local or read_only), read_only=read_only,
            enable_async_checkpointing=async_save and not read_only,
            cleanup_tmp_directories=not read_only, multiprocessing_options=multiprocessing,
        )  # fmt: skip
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, data_position: dict[str, int],
             config: dict[str, Any], extra: dict[str, Any] | None = None, *,
             drafter: Any = None, drafter_buffer: dict | None = None,
             weights: str | None = None, tokenizer: str | None = None,
             data_files: str | None = None) -> bool:  # fmt: skip
        """Starts saving (returns before the files are written when async). False if present.

        Args:
          weights: the fingerprint of the model's checkpoint file (None: a random preset).
          tokenizer: the fingerprint of its tokenizer files (None: none to fingerprint).
          data_files: the fingerprint of the dataset files read (None: generated data).
        """
        if self._read_only:
            raise ValueError(f"{self.directory} was opened read-only: it saves nothing")
        if step in self._manager.all_steps():
            return False
        if self._process_local:  # orbax saves only global arrays across processes: host copies
            state, drafter = jax.device_get((state, drafter))
        items = dict(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave({k: int(v) for k, v in data_position.items()}),
            config=ocp.args.JsonSave(config),
            extra=ocp.args.JsonSave(extra or {}),
        )
        fingerprints = {"fingerprint": weights, "tokenizer": tokenizer, "data_files": data_files}
        fingerprints = {k: v for k, v in fingerprints.items() if v is not None}
        if fingerprints:
            items["weights"] = ocp.args.JsonSave(fingerprints)
        if drafter is not None:
            items["drafter"] = ocp.args.StandardSave(drafter)
        if drafter_buffer is not None:
            items["drafter_buffer"] = ocp.args.StandardSave(drafter_buffer)
        return self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def read_config(self, step: int | None = None) -> dict[str, Any] | None:
        """The run config stored with the checkpoint at `step` (default latest); None if there
        is no checkpoint. Reads nothing else."""
        return self._read_json("config", step)

    def read_weights(self, step: int | None = None) -> str | None:
        """The weights fingerprint stored with the checkpoint at `step` (default latest); None
        if there is no checkpoint or it has none (a preset's run, or written before it existed).
        Reads nothing else."""
        return (self._read_json("weights", step) or {}).get("fingerprint")

    def read_tokenizer(self, step: int | None = None) -> str | None:
        """The tokenizer files' fingerprint stored with the checkpoint at `step` (default
        latest); None if there is none (the byte tokenizer, a GGUF file, or a checkpoint
        written before it existed). Reads nothing else."""
        return (self._read_json("weights", step) or {}).get("tokenizer")

    def read_data_files(self, step: int | None = None) -> str | None:
        """The dataset files' fingerprint stored with the checkpoint at `step` (default latest);
        None if there is none (generated data, or a checkpoint written before it existed)."""
        return (self._read_json("weights", step) or {}).get("data_files")

    def read_shapes(self, item: str, step: int | None = None) -> dict[str, tuple] | None:
        """`{leaf path: shape}` of the arrays of `item` (e.g. "drafter") in the checkpoint at
        `step` (default latest), from orbax's metadata: no array is read. Paths join the
        pytree's keys with "/" (`tree_paths`). None if there is no such checkpoint or item."""
        step = self.latest_step() if step is None else step
        path = self.directory / str(step) / item
        if step is None or not path.exists():
            return None
        metadata = ocp.StandardCheckpointHandler().metadata(path)
        return tree_paths(getattr(metadata, "tree", metadata))

    def _read_json(self, item: str, step: int | None) -> dict[str, Any] | None:
        step = self.latest_step() if step is None else step
        if step is None or not (self.directory / str(step) / item).exists():
            return None
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))  # fmt: skip
        return dict(restored[item])

    def _resume_hint(self, step: int) -> str:
        """What a user can do about an unreadable checkpoint `step`."""
        earlier = [s for s in self.all_steps() if s < step]
        return (f"move it aside to resume from step {earlier[-1]}" if earlier
                else "no earlier checkpoint is here")  # fmt: skip

    def restore(self, like: Any, step: int | None = None, *, drafter_like: Any = None
                ) -> Restored | None:  # fmt: skip
        """The checkpoint at `step` (default latest) laid out like `like`; None if there is none.

        Args:
          like: a state pytree (arrays or `ShapeDtypeStruct`s with shardings) giving the
            structure, dtypes and shardings to restore into.
          step: which checkpoint; the latest by default.
          drafter_like: the online drafter's state, if the run has one (restored when the
            checkpoint holds it; `Restored.drafter` is None otherwise).
        """
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        items = {"state": ocp.args.StandardRestore(self._target(like)),
                 "data": ocp.args.JsonRestore(), "config": ocp.args.JsonRestore()}  # fmt: skip
        has_extra = (self.directory / str(step) / "extra").exists()
        if has_extra:
            items["extra"] = ocp.args.JsonRestore()
        has_drafter = drafter_like is not None and (self.directory / str(step) / "drafter").exists()
        if has_drafter:
            items["drafter"] = ocp.args.StandardRestore(self._target(drafter_like))
        has_buffer = has_drafter and (self.directory / str(step) / "drafter_buffer").exists()
        if has_buffer:  # host arrays of the shapes they were saved with
            items["drafter_buffer"] = ocp.args.StandardRestore()
        missing = [item for item in ("state", "data", "config")
                   if not (self.directory / str(step) / item).is_dir()]  # fmt: skip
        if missing:  # orbax would raise a KeyError naming neither the step nor what to do
            raise ValueError(f"checkpoint {self.directory}/{step} cannot be read (its "
                             f"{missing} part is missing: files lost after it was saved); "
                             f"{self._resume_hint(step)}")  # fmt: skip
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except FileNotFoundError as e:  # a part's own files lost (its metadata, an array)
            raise ValueError(
                f"checkpoint {self.directory}/{step} cannot be read (files lost "
                f"after it was saved); {self._resume_hint(step)}: {e}"
            ) from e
        except ValueError as e:  # orbax names a shape, not the checkpoint or its run
            if self._fits(step, "state", like) is not False and (
                    not has_drafter or self._fits(step, "drafter", drafter_like) is not False
            ):  # fmt: skip
                # Arrays of this run's paths and shapes, or arrays whose own metadata cannot be
                # read: files lost or damaged after the save committed (a save cut short is
                # never a step), not a checkpoint of another model.
                raise ValueError(
                    f"checkpoint {self.directory}/{step} cannot be read (files lost or damaged "
                    f"after it was saved, not another model's); {self._resume_hint(step)}: {e}"
                ) from e
            model = (self.read_config(step) or {}).get("model")
            raise ValueError(
                f"checkpoint {self.directory}/{step} does not fit this run's state (a workdir "
                f"of another model config? the checkpoint's model settings: {model}): {e}"
            ) from e
        extra = dict(restored.extra) if has_extra else {}
        state = self._placed(restored.state, like)
        drafter = self._placed(restored.drafter, drafter_like) if has_drafter else None
        buffer = ({k: np.asarray(v) for k, v in restored.drafter_buffer.items()}
                  if has_buffer else None)  # fmt: skip
        return Restored(step, state, dict(restored.data), dict(restored.config), extra, drafter,
                        buffer)  # fmt: skip

    def _fits(self, step: int, item: str, like: Any) -> bool | None:
        """Whether `item`'s array paths and shapes at `step` (orbax's metadata) are `like`'s;
        None when that metadata cannot be read (it lives in the array store too)."""
        try:
            shapes = self.read_shapes(item, step)
        except (ValueError, FileNotFoundError):  # tensorstore's read errors (NOT_FOUND,
            return None  # DATA_LOSS, ...), orbax's for a lost _METADATA
        return shapes == tree_paths(like)

    def _target(self, like):
        if self._process_local:  # restored as host arrays, then placed like `like`
            return jax.tree.map(lambda x: np.empty(x.shape, x.dtype), like)
        return abstract_like(like)

    def _placed(self, tree, like):
        if not self._process_local:
            return tree
        return jax.device_put(tree, jax.tree.map(lambda x: x.sharding, like))


class DrafterCheckpointer(_Checkpointer):
    """Orbax checkpoints of a `DrafterTrainState` only (never the policy's embed / head).

    Every `save_every` steps (or when forced), keeping the last `keep`; each checkpoint also
    records the drafter's architecture, and the digest of the policy it is trained for, so a
    mismatched resume fails loudly.
    """

    def __init__(self, directory: str | os.PathLike, target_config: ModelConfig, *,
                 keep: int = 3, save_every: int = 1, async_save: bool = True,
                 policy_weights: str | None = None):  # fmt: skip
        """
        Args:
          policy_weights: a digest of the policy's weights (`warmup.policy_digest`): a
            workdir of a drafter trained for another policy of the same architecture (a base
            vs an instruct model, an RL-trained one) is then refused, not resumed.
        """
        self.directory = Path(directory).expanduser().absolute()
        self._metadata = drafter_config(target_config).to_hf_dict()
        if policy_weights is not None:
            self._metadata["policy_weights"] = policy_weights
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=save_every, create=True,
            enable_async_checkpointing=async_save, cleanup_tmp_directories=True,
        )  # fmt: skip
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, state: Any, *, force: bool = False) -> bool:
        """Starts saving `state` at its step if due (or `force`); returns whether it saves."""
        step = int(jax.device_get(state.step))
        if step in self._manager.all_steps():
            return False
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(self._metadata)
        )
        return self._manager.save(step, args=args, force=force)

    def check(self, step: int | None = None, policy_weights: str | None = None) -> int | None:
        """Reads only the architecture (and policy digest) stored with the checkpoint at
        `step` (default latest) and compares them with this drafter's, before anything is
        generated, compiled or restored; returns the step checked (None: no checkpoint).

        Args:
          policy_weights: the policy digest to compare with (default: this checkpointer's).

        Raises:
          ValueError: when the checkpoint belongs to a different drafter architecture, naming
            the directory and the differing fields, or was trained for another policy.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        stored = dict(self._manager.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config)  # fmt: skip
        expected = dict(self._metadata)
        policy = (stored.pop("policy_weights", None), expected.pop("policy_weights", None))
        policy = (policy[0], policy_weights or policy[1])
        if stored != expected:
            diff = {k: (stored.get(k), expected.get(k)) for k in sorted(stored.keys() | expected)
                    if stored.get(k) != expected.get(k)}  # fmt: skip
            raise ValueError(
                f"checkpoint {self.directory}/{step} is for another drafter: "
                f"(checkpoint, expected) differ at {diff}"
            )
        if None not in policy and policy[0] != policy[1]:  # older checkpoints record none
            raise ValueError(
                f"checkpoint {self.directory}/{step} holds a drafter trained for another policy "
                f"(weights digest {policy[0]}, this policy's {policy[1]}): resuming would keep "
                "(or re-export) that drafter; use another --workdir"
            )
        return step

    def restore(self, like: Any, step: int | None = None) -> Any:
        """The checkpointed state (latest unless `step`), laid out like `like`; None if none.

        `like` may be abstract (`jax.eval_shape` of the initial state); leaves without a
        sharding are restored onto the default device.

        Raises:
          ValueError: when the checkpoint belongs to a different drafter architecture (checked
            before the state is read, whose shapes may not fit `like`).
        """
        step = self.check(step)
        if step is None:
            return None
        default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=getattr(x, "sharding", None) or default), like)  # fmt: skip
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))  # fmt: skip
        return restored.state
