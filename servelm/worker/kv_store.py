"""The engine process's side of KV cache persistence: /admin/kv/save and /load requests, the restore at start
and the save at shutdown of `--kv-cache-persist DIR`. The file format is servelm.engine.kv_persist's."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from servelm.worker import messages as m

if TYPE_CHECKING:
    from servelm.engine.core import EngineCore
    from servelm.model.loading.source import ModelSource

logger = logging.getLogger("servelm.engine")


class KVStore:
    def __init__(self, core: EngineCore, source: ModelSource, directory: str | None) -> None:
        self.core, self.source, self.directory = core, source, directory
        self._digest: str | None = None

    @property
    def digest(self) -> str:
        """The model hash, computed on first use (it reads the weight files once)."""
        if self._digest is None:
            from servelm.engine.kv_persist import model_hash

            self._digest = model_hash(self.source, self.core.model.spec,
                                      getattr(self.core.model, "quantization", "none"))
        return self._digest

    def reset_digest(self) -> None:
        """The weights changed: the hash is computed again (from `source`) when next needed."""
        self._digest = None

    def _path(self, path: str | None) -> Path:
        from servelm.engine.kv_persist import default_file

        if path is None:
            if self.directory is None:
                raise _Invalid("give a path, or start the server with --kv-cache-persist DIR")
            return default_file(self.directory, self.digest)
        p = Path(path).expanduser()
        return default_file(p, self.digest) if p.is_dir() or path.endswith("/") else p

    def handle(self, op: m.KVCacheOp) -> m.KVCacheDone:
        """Run a save or load between steps; every failure is answered, none ends the engine."""
        from servelm.engine import kv_persist as kp

        try:
            if op.action not in ("save", "load"):
                raise _Invalid(f"unknown action {op.action!r}")
            if self.core.config.parallel_config.tensor_parallel_size > 1:
                raise _Invalid("KV cache save and restore are not supported with tensor parallelism (each rank "
                               "holds its own heads of every block)")
            if not self.core.kv.pool.enable_caching:
                raise _Invalid("prefix caching is off in this engine: there is no cache to save or restore")
            path = self._path(op.path)
            if op.action == "save":
                done = kp.save(self.core, path, self.digest)
            else:
                if not path.is_file():
                    return m.KVCacheDone(op.op_id, "not_found", f"no KV cache file at {path}", str(path))
                done = kp.load(self.core, path, self.digest)
        except _Invalid as e:
            return m.KVCacheDone(op.op_id, "invalid", str(e))
        except kp.KVMismatchError as e:
            return m.KVCacheDone(op.op_id, "mismatch", str(e), op.path or "")
        except kp.KVFormatError as e:
            logger.warning("KV cache file %s ignored: %s", op.path, e)
            return m.KVCacheDone(op.op_id, "corrupt", f"the KV cache file is damaged and was ignored: {e}",
                                 op.path or "")
        except OSError as e:
            return m.KVCacheDone(op.op_id, "invalid", f"cannot {op.action} the KV cache file: {e}", op.path or "")
        except Exception as e:  # a bug here must not take the engine (and its requests) down
            logger.exception("KV cache %s failed", op.action)
            return m.KVCacheDone(op.op_id, "internal", f"KV cache {op.action} failed: {type(e).__name__}: {e}")
        logger.info("KV cache %s: %d blocks (%d skipped), %d bytes, %.2fs, %s", "saved" if op.action == "save"
                    else "restored", done.num_blocks, done.num_skipped, done.size_bytes, done.seconds, done.path)
        return m.KVCacheDone(op.op_id, None, "", done.path, done.num_blocks, done.num_skipped, done.size_bytes,
                             done.seconds)

    def restore_at_start(self) -> None:
        """--kv-cache-persist: restore this model's file if there is one; a refused or damaged file is logged
        and left alone (the next shutdown overwrites it), never a failed start."""
        if self.directory is None:
            return
        done = self.handle(m.KVCacheOp(0, "load"))
        if done.error == "not_found":
            logger.info("no saved KV cache for this model in %s", self.directory)
        elif done.error is not None:
            logger.warning("saved KV cache not restored: %s", done.message)

    def save_at_shutdown(self) -> None:
        if self.directory is None:
            return
        done = self.handle(m.KVCacheOp(0, "save"))
        if done.error is not None:
            logger.warning("KV cache not saved at shutdown: %s", done.message)


class _Invalid(ValueError):
    pass
