"""The ``lightning-pipe`` command: Hydra configuration in ``lightning_pipe/conf/``, recipes in
``lightning_pipe/recipes/``.

    lightning-pipe                                        # tiny BERT, 2 CPU stages, offline
    lightning-pipe recipe=vgg19_cifar100 strategy=gpipe strategy.chunks=8 trainer.devices=4
    lightning-pipe -m strategy.chunks=2,4                 # a sweep, one output folder per run
    lightning-pipe --cfg job                              # print the composed configuration
    lightning-pipe checkpoint=true logger=tensorboard     # save checkpoints, metrics to TensorBoard

A run prints its folder first and a summary last (rank 0); a key that nothing reads fails before
anything starts (:func:`check_keys`).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
import warnings
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any, cast

import hydra
import lightning as L
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_pipe.checkpoint import is_pipeline_checkpoint, not_a_checkpoint
from lightning_pipe.command_keys import INTERNAL_KEYS, SET_BY_THE_COMMAND, check_overrides, hint, top_level_keys
from lightning_pipe.config import PartitionConfig, cli_keys
from lightning_pipe.observe.run_report import summary_lines
from lightning_pipe.observe.stage_metrics import StageMetrics
from lightning_pipe.partition import find_sequential, resolve_balance, tied_parameters
from lightning_pipe.runtime.microbatch import batch_size
from lightning_pipe.schedules import TRAITS, traits
from lightning_pipe.schedules.text import TEXT_SUFFIXES
from lightning_pipe.strategy import PipelineStrategy
from lightning_pipe.trainer.launch.launcher import PipelineMultiProcessingLauncher

log = logging.getLogger(__name__)

# what Lightning's script launcher sets in the environment for the processes of a run
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
CONFIG_DIR = str(Path(str(files("lightning_pipe.conf"))).resolve())
#: PipelineConfig's arguments that a command line can give (not the callables): one per field of the config
STRATEGY_KEYS = cli_keys()
LOGGERS = ("csv", "tensorboard")


def _replicas(trainer: L.Trainer) -> int:
    """Data-parallel replicas of the pipeline: each reads its own batch of every step."""
    return int(getattr(trainer.strategy, "num_replicas", 1))


class SamplesPerSecond(L.Callback):
    """Logs ``samples_per_sec`` (shown in the progress bar) from each step's wall time: the samples
    of the whole step, over all replicas."""

    def __init__(self) -> None:
        self._start = 0.0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        seconds = time.perf_counter() - self._start
        samples = batch_size(batch) * _replicas(trainer)
        pl_module.log("samples_per_sec", samples / seconds, prog_bar=True, on_step=True, on_epoch=False)


class RunSummary(L.Callback):
    """Prints, on global rank 0 once training is over, where the run went and how it went (see
    :func:`lightning_pipe.observe.run_report.summary_lines`). ``started``: ``time.time()`` when the command
    began, so the wall time includes starting the processes."""

    def __init__(self, output: Path, started: float) -> None:
        self.output, self.started = output, started
        self.samples = 0
        self.train_seconds = 0.0
        self.text: str | None = None
        self._last_loss: float | None = None
        self._train_start: float | None = None
        self._validation_start: float | None = None
        self._validation_seconds = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._train_start = time.perf_counter()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._train_start is not None:  # not the sanity check before training
            self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._validation_start is not None:
            self._validation_seconds += time.perf_counter() - self._validation_start
            self._validation_start = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.samples += batch_size(batch) * _replicas(trainer)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            self._last_loss = float(loss)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._train_start is not None:
            self.train_seconds = time.perf_counter() - self._train_start - self._validation_seconds

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        logged = trainer.callback_metrics.get("train_loss")  # what the progress bar showed last
        checkpoint = trainer.checkpoint_callback
        saved = (
            (checkpoint.last_model_path or checkpoint.best_model_path)
            if isinstance(checkpoint, ModelCheckpoint)
            else ""
        )
        self.text = summary_lines(
            self.output, str(Path(saved).resolve()) if saved else None,
            float(logged) if logged is not None else self._last_loss, trainer.global_step,
            time.time() - self.started, self.samples, self.train_seconds, written_files(self.output, trainer),
        )  # fmt: skip

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Started with spawn/fork, this is a worker whose state the launching process does not get back:
        # print here. Otherwise `run` prints it once `fit` returns, below the progress bar's last line.
        if self.text is not None and isinstance(trainer.strategy.launcher, PipelineMultiProcessingLauncher):
            print(self.text, flush=True)


def written_files(output: Path, trainer: L.Trainer) -> list[str]:
    """What the run wrote besides its checkpoint: the logger's folder (metrics.csv, or TensorBoard's
    event files), the timeline and the run's log files, as paths in ``output``."""
    found = []
    log_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
    if log_dir is not None and Path(log_dir).is_dir():
        metrics = Path(log_dir) / "metrics.csv"
        found.append(str(metrics) if metrics.is_file() else f"{log_dir} (TensorBoard: tensorboard --logdir {log_dir})")
    found += [str(p) for p in (output / "timeline.svg", output / "plan.txt", output / "plan.svg") if p.is_file()]
    found += [str(p) for p in sorted(output.glob("*.log"))]
    return found


class PlanOnly(L.Callback):
    """``lightning-pipe plan``: once the planner ranked the layouts (in the strategy's setup), print
    and write them (``plan.txt``, ``plan.svg``) and stop before the first step. Every stages x
    replicas of the world is ranked for the run's global batch; a layout with other replicas than
    configured needs ``strategy.stages`` and the DataLoader batch (per replica) set as printed, which
    the printed overrides do. Nothing that looks like training is shown: no model summary, no
    sanity-check validation."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning.pytorch.callbacks import ModelSummary

        # the summary (printed at fit start, after this callback) and the sanity check would read as a start of training
        # Lightning's callback connector sets trainer.callbacks, which the Trainer's class does not declare
        trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ModelSummary)]  # type: ignore[attr-defined]
        trainer.num_sanity_val_steps = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_pipe.plan.report import write_plan

        trainer.should_stop = True
        if trainer.global_rank != 0:
            return
        strategy = trainer.strategy
        ranked = getattr(strategy, "plan_candidates", None)
        if not ranked:
            stages = getattr(strategy, "num_stages", 1)
            print(
                "lightning-pipe plan: nothing to rank: the planner needs a pipeline of at least 2 stages, and this "
                f"run has {stages} on {trainer.world_size} process(es). Set trainer.devices to 2 or more, and "
                "strategy.stages to 2 or more (or leave it unset: one stage per process).",
                flush=True,
            )
            return
        assert isinstance(strategy, PipelineStrategy)  # the only one with plan_candidates
        print(write_plan(ranked, strategy.num_stages, strategy.num_replicas, self.folder), flush=True)
        print(f"written: {self.folder / 'plan.txt'}, {self.folder / 'plan.svg'}", flush=True)


def build_strategy(cfg: DictConfig, devices: Any, defaults: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """The Trainer's ``strategy`` and ``devices`` for the ``strategy`` config group. ``defaults``:
    strategy arguments the recipe's model asks for (its ``strategy_defaults``, say the ``module``
    that holds its blocks), used where the group leaves them unset."""
    if cfg.name == "none":
        if str(devices) != "1":
            log.warning(
                "strategy=none: training without the pipeline, in one process on one device; trainer.devices=%s "
                "applies to the pipeline strategies (strategy=%s).",
                devices,
                ", ".join(TRAITS),
            )
        return "auto", 1
    if cfg.name != "pipeline":
        raise ValueError(f"strategy.name={cfg.name!r}: valid names are 'pipeline' and 'none'.")
    args = {k: v for k, v in (defaults or {}).items() if v is not None}
    args.update({k: cfg[k] for k in STRATEGY_KEYS if k in cfg and cfg[k] is not None})
    if isinstance(
        args.get("loss_weight"), DictConfig
    ):  # strategy.loss_weight={_target_:lightning_pipe.token_count,...}
        args["loss_weight"] = instantiate(args["loss_weight"])
    for key in ("schedule_text", "schedule"):  # schedule=mine.csv: the former way, with a DeprecationWarning
        given = args.get(key)
        if isinstance(given, str) and given.endswith(TEXT_SUFFIXES) and Path(given).is_file():
            args[key] = str(Path(given).resolve())  # a schedule text's path, the same from every process
    # lists (balance, rank_speeds, rank_order) as Python's: the config checks their items
    args = {k: OmegaConf.to_container(v) if isinstance(v, ListConfig) else v for k, v in args.items()}
    return PipelineStrategy(**args), devices


def check_keys(cfg: DictConfig) -> None:
    """Refuse a key that nothing reads, naming it and the valid ones: at the top level and in the
    ``recipe``, ``strategy`` and ``trainer`` nodes (``recipe.model`` and ``recipe.data``:
    :func:`instantiate_recipe`). Hydra refuses a new key unless it is added with ``+``, as its own
    message suggests; a misspelt key added that way would otherwise be ignored without a word."""
    problems = _unknown_keys("", cfg, top_level_keys(), hidden=("hydra", *INTERNAL_KEYS))
    problems += _unknown_keys("recipe.", cfg.recipe, ("name", "model", "data"))  # their keys: instantiate_recipe
    name = cfg.strategy.get("name")
    if name in ("pipeline", "none"):
        problems += _unknown_keys(
            "strategy.", cfg.strategy, ("name", *STRATEGY_KEYS) if name == "pipeline" else ("name",)
        )
    trainer = [
        p for p in inspect.signature(L.Trainer.__init__).parameters if p != "self" and p not in SET_BY_THE_COMMAND
    ]
    for key in cfg.trainer:
        if key in SET_BY_THE_COMMAND:
            problems.append(f"trainer.{key} is set by lightning-pipe: {SET_BY_THE_COMMAND[key]}.")
    problems += _unknown_keys("trainer.", cfg.trainer, trainer)
    if problems:
        raise SystemExit("\n".join(f"lightning-pipe: {problem}" for problem in problems))


def _unknown_keys(prefix: str, node: DictConfig, valid: Any, hidden: Any = ()) -> list[str]:
    """One message per key of ``node`` neither in ``valid`` nor in ``hidden`` (accepted, not listed);
    the Trainer arguments the command sets itself are reported apart."""
    valid = sorted(valid)
    problems = []
    for key in node:
        if key in valid or key in hidden or (prefix == "trainer." and key in SET_BY_THE_COMMAND):
            continue
        close = hint(prefix, str(key), valid)
        problems.append(f"unknown key {prefix}{key!s}{close}: nothing reads it. Valid keys: {', '.join(valid)}.")
    return problems


def instantiate_recipe(cfg: DictConfig, part: str) -> Any:
    """``recipe.<part>`` (``model`` or ``data``) built by Hydra. A key its ``_target_`` does not take
    fails naming the valid ones (the arguments of the target, which may be more than the recipe's
    file lists). The target is inspected only once ``instantiate`` has located it, under Hydra's
    own rules for which targets a configuration may name."""
    node = cfg.recipe[part]
    try:
        return instantiate(node)
    except InstantiationException as error:
        if not isinstance(error.__cause__, TypeError):
            raise
        target = get_object(str(node["_target_"]))  # imported by instantiate already
        parameters = inspect.signature(target).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            raise
        hydra_keys = [str(k) for k in node if str(k).startswith("_") and str(k).endswith("_")]  # _target_, ...
        valid = [p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL]
        problems = _unknown_keys(f"recipe.{part}.", node, valid, hidden=hydra_keys)
        if not problems:  # a TypeError of the target's own
            raise
        raise SystemExit("\n".join(f"lightning-pipe: {problem}" for problem in problems)) from error


def make_logger(name: str, output: Path) -> Logger:
    """The run's logger, writing to ``<output>/logs/version_N``."""
    if name == "csv":
        return CSVLogger(str(output), name="logs")
    if name == "tensorboard":
        try:
            return TensorBoardLogger(str(output), name="logs")
        except ModuleNotFoundError as error:
            raise SystemExit(
                f"lightning-pipe: logger=tensorboard needs TensorBoard: pip install tensorboard ({error})"
            ) from error
    raise SystemExit(f"lightning-pipe: logger={name!r} is unknown. Valid: {', '.join(LOGGERS)}.")


def check_tied_weights(cfg: DictConfig, model: L.LightningModule, devices: Any) -> None:
    """Schedules that refuse weights tied across stages (``refuses_ties``): say so before any process starts,
    naming the override that unties them (the strategy itself would fail in every process)."""
    if (
        cfg.strategy.name != "pipeline"
        or not traits(cfg.strategy.schedule).refuses_ties
        or not isinstance(devices, int)
        or devices < 2
    ):
        return
    try:
        attribute, layers = find_sequential(model, cfg.strategy.get("module"))
        # null: the recipe's choice (its strategy_defaults), else PipelineConfig's, as build_strategy gives it
        chosen = getattr(model, "strategy_defaults", None) or {}
        balance = cfg.strategy.balance or chosen.get("balance") or PartitionConfig.balance
        balance = balance if isinstance(balance, str) else [int(n) for n in balance]
        ties = tied_parameters(layers, resolve_balance(balance, layers, devices))
    except (ValueError, TypeError):
        return  # a bad module or balance: the strategy names it
    if not ties:
        return
    names = ", ".join(sorted({f"{attribute}.{name}" for tie in ties for name in tie.values()}))
    fix = "add recipe.model.tie_embeddings=false" if "tie_embeddings" in cfg.recipe.model else "untie them in the model"
    raise SystemExit(
        f"lightning-pipe: strategy.schedule={cfg.strategy.schedule} cannot train weights shared by layers of "
        f"different stages ({names}): {fix}, or use strategy=pipedream_2bw."
    )


def resume_path(value: Any, output: Path, searched: Sequence[Path]) -> str | None:
    """The checkpoint ``resume=`` names: None for ``null``; ``last``: ``checkpoints/last.ckpt`` of this
    run's folder (``hydra.run.dir`` of an earlier run), else the newest one under ``searched`` (the
    ``outputs`` and ``multirun`` folders); a run's folder: its ``checkpoints/last.ckpt``; else the path.
    Refused before anything starts when there is none."""
    if value is None or value is False or str(value) in ("", "null", "none", "false"):
        return None
    if str(value) == "last":
        own = output / "checkpoints" / "last.ckpt"
        if own.exists():
            return str(own)
        found = [c for root in searched if root.is_dir() for c in root.glob("**/checkpoints/last.ckpt")]
        if not found:
            where = ", ".join(str(r) for r in [output, *searched])
            raise SystemExit(
                f"lightning-pipe: resume=last: no checkpoints/last.ckpt under {where}. Save one with checkpoint=true, "
                "or give the checkpoint's path: resume=PATH."
            )
        return str(max(found, key=lambda c: c.stat().st_mtime).resolve())
    path = Path(str(value)).expanduser()
    if not path.is_absolute():
        path = Path(_original_cwd()) / path
    if path.is_dir() and not (path / "meta.pt").exists() and (path / "checkpoints" / "last.ckpt").exists():
        path = path / "checkpoints" / "last.ckpt"  # a run's folder
    if not path.exists():
        raise SystemExit(
            f"lightning-pipe: resume={value}: {path} does not exist. Give a checkpoint (a run's checkpoints/last.ckpt) "
            "or resume=last."
        )
    if path.is_dir() and not is_pipeline_checkpoint(path):  # neither a checkpoint nor a run's folder with one
        raise SystemExit(
            f"lightning-pipe: resume={value}: {not_a_checkpoint(path)} A run's folder resumes from its "
            "checkpoints/last.ckpt, which this one does not have (a run saves it with checkpoint=true)."
        )
    return str(path.resolve())


def _original_cwd() -> str:
    """Where the command was started (Hydra may change into the run's folder)."""
    try:
        from hydra.utils import get_original_cwd

        return get_original_cwd()
    except ValueError:  # not under @hydra.main (tests calling run)
        return os.getcwd()


class _NoTips(logging.Filter):
    """Drops Lightning's advertising tips (``💡 Tip: ...``), which no Trainer setting turns off."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith("💡 Tip")


def run(cfg: DictConfig, output_dir: str | None = None) -> dict[str, float]:
    """Train the configured recipe; returns the final metrics (on every rank)."""
    started = time.time()
    check_keys(cfg)
    quiet_libraries()
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    output = Path(output_dir or HydraConfig.get().runtime.output_dir).resolve()
    cwd = Path(_original_cwd())
    resume = resume_path(cfg.get("resume"), output, [cwd / "outputs", cwd / "multirun"])
    _say(f"lightning-pipe: output folder {output}")
    if resume is not None:
        _say(f"lightning-pipe: resuming from {resume}")
    logger = make_logger(str(cfg.get("logger", "csv")), output)
    trainer_cfg = cast("dict[str, Any]", OmegaConf.to_container(cfg.trainer, resolve=True))  # keys: Trainer arguments
    assert isinstance(trainer_cfg, dict)
    model = instantiate_recipe(cfg, "model")
    try:
        strategy, devices = build_strategy(
            cfg.strategy, trainer_cfg.pop("devices"), getattr(model, "strategy_defaults", None)
        )
    except (ValueError, TypeError) as error:  # a bad strategy value: one sentence, no traceback
        raise SystemExit(f"lightning-pipe: {error}") from error
    check_tied_weights(cfg, model, devices)
    data = instantiate_recipe(cfg, "data")
    if "LOCAL_RANK" not in os.environ:  # the launching process: missing data fails here, before the others start
        try:
            data.prepare_data()
        except (OSError, RuntimeError, ValueError) as error:
            raise SystemExit(f"lightning-pipe: {error}") from error
    callbacks: list[L.Callback] = [SamplesPerSecond(), *progress_bar(trainer_cfg)]
    summary: RunSummary | None = None
    if cfg.get("plan_only", False):
        callbacks.append(PlanOnly(output))
        if isinstance(strategy, PipelineStrategy):
            strategy.plan_all_layouts = True  # rank stages x replicas too (printed, not applied)
    else:
        summary = RunSummary(output, started)
        callbacks.append(summary)
        if cfg.strategy.name == "pipeline":
            callbacks.append(StageMetrics())  # pipeline/stage{s}/bubble, samples_per_sec, peak memory: to the logger
    if cfg.get("timeline", False) and cfg.strategy.name == "pipeline":
        from lightning_pipe.observe.picture import TimelinePicture

        # the file, and the same picture as an image where the logger takes images (a CSV logger does not)
        callbacks.append(TimelinePicture(output / "timeline.svg", to_loggers=isinstance(logger, TensorBoardLogger)))
    if cfg.get("checkpoint", False):
        callbacks.append(ModelCheckpoint(dirpath=output / "checkpoints", save_last=True))
    trainer = L.Trainer(
        strategy=strategy,
        devices=devices,
        default_root_dir=str(output),
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=bool(cfg.get("checkpoint", False)),
        **trainer_cfg,
    )
    environment = {k: os.environ.get(k) for k in LAUNCH_VARIABLES}
    try:
        trainer.fit(model, datamodule=data, ckpt_path=resume)
    except Exception as error:
        raise SystemExit(failure_sentence(error, trainer.global_rank)) from error
    finally:
        _end_job(environment)
    if summary is not None and summary.text is not None:  # this process ran global rank 0
        print(summary.text, flush=True)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def progress_bar(trainer_cfg: dict[str, Any]) -> list[L.Callback]:
    """Lightning's TQDM progress bar, chosen here: where ``rich`` is installed (the ``hf`` extra brings it)
    Lightning would pick its rich bar, which writes ``Epoch 2/-2`` for a run bounded by steps (``max_epochs:
    -1``). None where ``trainer.enable_progress_bar=false`` (Lightning refuses a bar then)."""
    return [TQDMProgressBar()] if trainer_cfg.get("enable_progress_bar", True) else []


def failure_sentence(error: BaseException, rank: int) -> Any:
    """What a failed run prints: one sentence, from global rank 0 only (the others exit with status
    1 and print nothing), the rank that failed first and why where another rank's note explains it
    (:mod:`lightning_pipe.failures`). The traceback goes to the run's log file (``cli.log``,
    ``train_ddp_process_N.log``), not to the terminal; ``HYDRA_FULL_ERROR=1`` prints it too."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    record = logging.getLogger("lightning_pipe.failure")
    record.propagate = False
    for handler in files:
        if handler not in record.handlers:
            record.addHandler(handler)
    record.error("the run failed on rank %d", rank, exc_info=error)
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        import traceback

        traceback.print_exception(error)
    if rank != 0:
        return 1
    notes = [n for n in getattr(error, "__notes__", []) if n.startswith("lightning-pipe: ")]
    text = notes[0] if notes else f"lightning-pipe: {type(error).__name__}: {error}"
    where = f" (traceback in {files[0].baseFilename})" if files else ""
    return text.rstrip() + where


@rank_zero_only
def _say(text: str) -> None:
    """Print on the process that started the run only (Lightning's script launcher re-runs the
    command in the others)."""
    print(text, flush=True)


def _end_job(environment: dict[str, str | None]) -> None:
    """Leave nothing of this job's processes behind for the next job of a sweep, which runs in this
    process and starts its own extra processes: the process group, and the variables Lightning's
    launcher set (with ``LOCAL_RANK`` set, Lightning would take the processes as started already).
    The next job gets a new port even where ``MASTER_PORT`` was given: this process may still hold
    the finished job's store on the old one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in environment.items():
        if value is None or key == "MASTER_PORT":
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def _main(cfg: DictConfig) -> float | None:
    metrics = run(cfg)
    return metrics.get("train_loss")


def preflight(args: Sequence[str]) -> None:
    """Refuse, before Hydra creates the run's folder, what the composed configuration alone shows to be
    wrong: keys that nothing reads, a bad strategy value (``strategy.schedule=zigzag``), an unknown
    logger, a ``resume=`` path that does not exist. A sweep or a Hydra flag (``-m``, ``--cfg``) is
    left to Hydra, as is a configuration Hydra itself refuses (its message names the problem)."""
    if any(arg.startswith("-") for arg in args):
        return
    from hydra import compose, initialize_config_dir

    overrides = [arg for arg in args if not arg.lstrip("+~").startswith("hydra")]
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose("config", overrides=overrides)
    except Exception:
        return  # Hydra's own answer, when it runs the job, names the problem
    check_keys(cfg)
    if str(cfg.get("logger", "csv")) not in LOGGERS:
        raise SystemExit(f"lightning-pipe: logger={cfg.logger} is unknown. Valid: {', '.join(LOGGERS)}.")
    if cfg.get("resume") is not None and str(cfg.resume) != "last":
        resume_path(cfg.resume, Path.cwd(), [])
    if cfg.strategy.get("name") == "pipeline":
        try:
            with warnings.catch_warnings():  # said once, when the run builds it
                warnings.simplefilter("ignore")
                build_strategy(cfg.strategy, cfg.trainer.get("devices"))
        except (ValueError, TypeError) as error:
            raise SystemExit(f"lightning-pipe: {error}") from None


def quiet_libraries() -> None:
    """Leave out of a command-line run what its user cannot act on: Lightning's advertising tips and
    the deprecation warnings that Lightning and torch raise about each other's internals."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_NoTips())
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(lightning|torch|lightning_fabric)(\.|$)")


def main() -> None:
    """``lightning-pipe [plan] <overrides>``: ``plan`` ranks the layouts for the configured run
    (``strategy.plan=auto``) and stops before training."""
    if sys.argv[1:2] == ["plan"]:
        sys.argv[1:2] = ["strategy.plan=auto", "+plan_only=true"]
    check_overrides(sys.argv[1:])
    preflight(sys.argv[1:])
    _main()


if __name__ == "__main__":
    main()
