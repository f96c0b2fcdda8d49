"""``StagePipeline``: one rank's share of the pipeline, driven one batch at a time.

Built once (per setup) from the run's values (:class:`~lightning_pipe.runtime.options.PipelineOptions`,
:class:`~lightning_pipe.runtime.topology.Placement`), the split (the stage modules this rank
holds) and the process groups, it owns everything a step touches below Lightning: the executor
that walks the schedule, the transport to the neighbouring stages, the per-step agreement on what
the stages loaded, the stage's gradients (replicas, shards, weights tied across stages, clipping
by the global norm), the weight versions of asynchronous schedules, and the timeline. A caller
drives it with a few verbs and never reaches inside:

- :meth:`agree` starts comparing this step's batch with the other stages' (checked before the
  step's first receive, inside the next verb);
- :meth:`train_step` runs a batch's forwards and backwards and keeps the gradients away from
  whatever zeroes ``.grad`` before the optimizer step; :meth:`hand_over_gradients` gives them to the
  parameters then; :meth:`clip_grad_norm_` clips them by the norm over every stage;
- :meth:`evaluate` runs a forward-only batch; :meth:`drain` finishes an asynchronous schedule's
  work in flight; :meth:`state_dict` / :meth:`load_state_dict` carry that schedule's state
  through a checkpoint; :meth:`enable_timeline` records every action; :meth:`close` undoes what
  the pipeline installed on the layers.

The user's code enters as a step function per micro-batch (``step(i)`` runs micro-batch ``i``'s
step and returns, on the last stage, the weighted loss to backpropagate): a verb hands it to the
executor's run with the agreement's check and the timeline (:class:`~lightning_pipe.runtime.executor.Callbacks`),
and the executor to the stage runner's forward; nothing keeps it after the verb. Nothing here
imports Lightning or the strategy's arguments, so the pipeline can be built and driven without a
Trainer (``tests/runtime/test_pipeline.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from lightning_pipe.runtime.agreement import BatchAgreement
from lightning_pipe.runtime.async_pipeline import AsyncPipeline
from lightning_pipe.runtime.asynchronous.delay_correction import delay_correction
from lightning_pipe.runtime.asynchronous.outside_owners import OutsideOwners, qualify, unqualify
from lightning_pipe.runtime.asynchronous.pipemare import PipeMare
from lightning_pipe.runtime.asynchronous.versions import WeightVersions
from lightning_pipe.runtime.asynchronous.xpipe import XPipe
from lightning_pipe.runtime.blocks.container import BlockStage
from lightning_pipe.runtime.crossing.carried import carrying_refusal
from lightning_pipe.runtime.crossing.skip_mail import SkipMail
from lightning_pipe.runtime.executor import Callbacks, Executor
from lightning_pipe.runtime.grads import deferred_conv, fused_linear
from lightning_pipe.runtime.grads.copies import loss_ranks, reaching, stage_copies
from lightning_pipe.runtime.grads.gradients import StageGradients, swap_grads, tie_groups
from lightning_pipe.runtime.grads.outside_agreement import check_outside_agreement
from lightning_pipe.runtime.options import ElasticAveraging, PipelineOptions
from lightning_pipe.runtime.overlap import overlap_hook
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.replicas.elastic_averaging import ElasticAverage
from lightning_pipe.runtime.replicas.pending import gather_pending, mean_pending, pending_for
from lightning_pipe.runtime.replicas.sharding import ShardedStage, shard_units
from lightning_pipe.runtime.stage import StageModule, StageRunner, StepFn
from lightning_pipe.runtime.timings import Timeline
from lightning_pipe.runtime.topology import Placement, Topology
from lightning_pipe.schedules import Schedule, update_delay
from lightning_pipe.schedules.families.interleaved import valid_microbatches
from lightning_pipe.schedules.runnable import runnable_schedule

#: A context to run a verb's compute in (the precision's autocast, for example).
Context = Callable[[], AbstractContextManager[Any]]


@dataclass
class StageSplit:
    """This rank's part of the split model.

    Attributes:
        host: the module that replaces the split ``nn.Sequential`` in the user's model: all of this
            rank's layers under their original names.
        stages: the stages this rank holds, by their index in the split; with one stage per rank,
            the host itself.
        ties: weights tied across pipeline positions: position -> the parameter's name in the user's
            model on that position (see :func:`lightning_pipe.partition.stages.virtual.ties_by_position`).
    """

    host: StageModule | BlockStage
    stages: dict[int, StageModule | BlockStage]
    ties: list[dict[int, str]] = field(default_factory=list)


class StagePipeline:
    """One rank's share of the pipeline (see the module docstring).

    Args:
        options: how the pipeline runs (the schedule, micro-batches, recomputation, fusion, sharding, PipeMare).
        placement: where this rank's stages sit in the layout, and its device and backend.
        split: the stage modules this rank holds.
        topology: the process groups of this rank (pipeline, replicas, the gloo group for headers).
        model: the user's model on this rank, holding ``split.host`` in place of its Sequential: a
            training step's gradients of all its parameters are kept until :meth:`hand_over_gradients`.
        shared: the parameters outside the split Sequential (each stage computes a part of their
            gradient), in the same order on every rank.
    """

    def __init__(
        self,
        options: PipelineOptions,
        placement: Placement,
        split: StageSplit,
        topology: Topology,
        model: nn.Module,
        shared: Sequence[nn.Parameter] = (),
    ) -> None:
        self.options = options
        self.placement, self.topology = placement, topology
        self.host, self.stages = split.host, split.stages
        self._schedules: dict[tuple[int, bool], Schedule] = {}
        self.timeline: Timeline | None = None  # see enable_timeline
        self._drain_after_update: Context | None = None  # asynchronous: a stop by max_steps drains after its update
        self._update_hooks: list[Any] = []
        # each part from the parts before it: sharding replaces the parameters the others hold
        self.shards, shared = self._shard(model, shared)
        self.params = list(model.parameters())
        self.gradients = self._stage_gradients(split.ties, model, shared)
        self.transport = self._transport()
        self.outside, self._everywhere = self._outside_parameters(model, shared)
        versions = WeightVersions(self.host, outside=self.outside) if options.schedule.asynchronous else None
        self.agreement = BatchAgreement(topology.meta_group, self.num_stages) if self.num_stages > 1 else None
        self._fused = self._weight_gradient_hooks(synchronous=versions is None)
        self.runners = self._runners(versions, model)
        self.executor = self._executor(model)
        self.elastic = self._elastic_average(model)
        self.asynchronous = self._async_pipeline()
        self.owners = self._outside_owners()

    # ------------------------------------------------------------------ the steps of building it
    def _shard(
        self, model: nn.Module, shared: Sequence[nn.Parameter]
    ) -> tuple[ShardedStage | None, list[nn.Parameter]]:
        """FSDP2 over the stage's replicas where the options shard it (the layers and the modules outside
        them), and ``shared`` as the parameters that replaced them (the same ones where nothing is sharded)."""
        if not (self.options.sharded and self.placement.num_replicas > 1):
            return None, list(shared)
        first_names = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
        shared_names = [first_names[id(p)] for p in shared]
        layers = len(list(self.host.children()))
        shards = ShardedStage(shard_units(model, self.host), self.topology.mesh["dp"], layers)
        renamed = dict(model.named_parameters(remove_duplicate=False))
        return shards, [renamed[n] for n in shared_names]

    def _stage_gradients(
        self, tied: list[dict[int, str]], model: nn.Module, shared: Sequence[nn.Parameter]
    ) -> StageGradients:
        """Where this stage's gradients go: weights tied across stages, the parameters outside the
        split (checked to agree first), Chimera's other copy, the replicas, the norm for clipping."""
        placement, topology, options = self.placement, self.topology, self.options
        named = dict(model.named_parameters(remove_duplicate=False))
        ties = tie_groups(tied, placement.layout, placement.stage, placement.replica, named, topology.group)
        check_outside_agreement(model, shared, topology.meta_group, self.num_stages)  # before any collective sums them
        # Chimera: the other copy of this rank's two stages is on the paired rank; their gradients are summed
        copies = None
        if options.schedule.mirrored:
            in_host = {id(p) for p in self.host.parameters()} | {id(p) for p in shared}
            ends = [p for p in model.parameters() if id(p) not in in_host]  # a block container's, with their stage
            copies = stage_copies(placement, topology.group, self.host, [p for _, p, _ in ties], ends)
        all_reduced = placement.num_replicas > 1 and self.shards is None and options.replicas_sync.mode == "allreduce"
        return StageGradients(
            shared,
            ties,
            topology.pp_group,
            self.num_stages,
            counts_shared=placement.stage == 0,
            norm_group=None if self.shards is not None else topology.pp_group,  # shards: every rank holds its own part
            dp_group=topology.dp_group if all_reduced else None,
            copies=copies,
        )

    def _transport(self) -> Transport:
        """Point-to-point to the neighbouring stages, batched under NCCL."""
        placement = self.placement
        return Transport(
            stage_ranks=placement.stage_ranks,
            device=placement.device,
            group=None,
            meta_group=self.topology.meta_group,
            batched=placement.backend == "nccl",
            through_host=placement.through_host,
        )

    def _outside_parameters(
        self, model: nn.Module, shared: Sequence[nn.Parameter]
    ) -> tuple[dict[str, nn.Parameter], set[str]]:
        """The trainable parameters outside the split layers on this rank (the ones every stage holds, and a
        block container's embeddings or head on an end stage), versioned with the stage's layers; and the
        names of those every stage holds."""
        in_host = {id(p) for p in self.host.parameters()}
        outside = {n: p for n, p in model.named_parameters() if id(p) not in in_host and p.requires_grad}
        everywhere = {id(p) for p in shared}
        return outside, {n for n, p in outside.items() if id(p) in everywhere}

    def _weight_gradient_hooks(self, synchronous: bool) -> list[nn.Module]:
        """The layers whose backward adds the micro-batches' weight gradients itself; and, for a synchronous
        schedule without a split backward or shards, the replicas' averaging as each gradient is ready (the
        readiness hooks fire in B, while deferred weight gradients are complete only after W: a split backward's
        replicas average after the step's last W)."""
        split_backward = synchronous and self.schedule(self.num_microbatches).split_backward
        fused = self._fuse_weight_gradients(split_backward)
        if synchronous and self.shards is None and not split_backward:
            self.gradients.overlap(self.params)
        return fused

    def _fuse_weight_gradients(self, split_backward: bool) -> list[nn.Module]:
        """The layers whose backward adds the micro-batches' weight gradients itself: a split backward's
        deferred work (W), or the fused ``nn.Linear`` accumulation; none under FSDP2, which accumulates."""
        if self.shards is not None:
            return []
        if split_backward:
            return deferred_conv.install_split(self.host)
        return fused_linear.install(self.host) if self.options.gradient_accumulation_fusion else []

    def _runners(self, versions: WeightVersions | None, model: nn.Module) -> dict[int, StageRunner]:
        """A runner per stage this rank holds, refusing carried values where the schedule cannot carry them;
        under weight versions the user's step reads the parameters outside the split from the version too."""
        activations = self.options.activations
        runners = {
            s: StageRunner(
                m,
                recompute=activations.recompute[s],
                versions=versions,
                host=self.host,
                offload=activations.offload[s],
            )
            for s, m in self.stages.items()
        }
        refusal = carrying_refusal(self.options.schedule)
        for runner in runners.values():
            runner.carry_refusal = refusal
            if versions is not None:
                runner.model, runner.outside = model, tuple(self.outside)
        return runners

    def _executor(self, model: nn.Module) -> Executor:
        """What walks the schedule's actions over this rank's runners, with the skips' mail between stages."""
        return Executor(
            self.transport,
            self.runners,
            rank=self.placement.stage,
            overlap=overlap_hook(model),
            crossing=SkipMail(self.transport, self.runners),
        )

    def _elastic_average(self, model: nn.Module) -> ElasticAverage | None:
        """``replicas_sync="elastic"``: no gradient all-reduce, a pull between the replicas every period."""
        sync = self.options.replicas_sync
        if not isinstance(sync, ElasticAveraging) or self.placement.num_replicas <= 1:
            return None
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        return ElasticAverage(trainable, self.topology.dp_group, sync.period, sync.alpha)

    def _async_pipeline(self) -> AsyncPipeline | None:
        """An asynchronous schedule's driver across optimizer steps, with its rule's techniques and delay correction."""
        if not self.options.schedule.asynchronous:
            return None
        rule, replicas = self.options.rule, self.placement.num_replicas
        correction = delay_correction(rule.delay_correction, rule.delay_correction_coefficient, replicas)
        schedule = self.options.schedule
        return AsyncPipeline(schedule, self.executor, self.runner, self.num_stages, self._pipemare(), correction)

    def _pipemare(self) -> PipeMare | None:
        """PipeMare's techniques for this stage where they are on (always under ``pipemare``, which
        needs its update count; under ``pipedream``/``pipedream_2bw`` with ``pipemare_warmup``), or
        XPipe's prediction (always under ``xpipe``)."""
        schedule, rule = self.options.schedule, self.options.rule
        ahead = schedule.predicts_ahead
        if not (schedule.predicts_weights or ahead) and rule.pipemare_warmup <= 0:
            return None
        delay = update_delay(schedule.name, self.num_stages, self.num_microbatches, self.placement.stage)
        if ahead:  # XPipe: PipeMare's machinery, forwards and backwards on predicted weights
            return XPipe(self.host, delay, rule.xpipe_predictor, rule.pipemare_warmup, self.outside)
        return PipeMare(
            self.host, delay, rule.pipemare_warmup, rule.pipemare_correction, rule.pipemare_decay, self.outside
        )

    def _outside_owners(self) -> OutsideOwners | None:
        """Under PipeMare's rescheduling the stages' step sizes differ: the parameters every stage holds
        follow their users' (:mod:`~lightning_pipe.runtime.asynchronous.outside_owners`)."""
        pipemare = self.asynchronous.pipemare if self.asynchronous is not None else None
        if pipemare is None or pipemare.warmup <= 0 or self.num_stages <= 1:
            return None
        named = {n: p for n, p in self.outside.items() if n in self._everywhere}
        return OutsideOwners(named, self.placement.stage, self.num_stages, self.topology.pp_group)

    # ------------------------------------------------------------------ what callers may read
    @property
    def num_stages(self) -> int:
        """Pipeline depth: processes per pipeline."""
        return self.placement.num_stages

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per training batch (a short batch takes fewer)."""
        return self.options.num_microbatches

    @property
    def runner(self) -> StageRunner:
        """The runner of this rank's first stage (the only one without interleaving)."""
        return self.runners[min(self.runners)]

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous schedule has work in flight (drain before saving or evaluating)."""
        return self.asynchronous is not None and self.asynchronous.in_flight

    def ends_here(self, num_microbatches: int) -> list[bool]:
        """Per micro-batch of a training step, whether its last stage, where the user's step computes
        the loss, is on this rank (with Chimera, the down pipeline's micro-batches end on the last
        process, the up pipeline's on the first)."""
        if self.asynchronous is not None:
            return [self.placement.is_last_stage] * num_microbatches
        schedule = self.schedule(num_microbatches)
        positions = self.placement.positions
        return [positions[schedule.chain_stages(i)[-1]] == self.placement.stage for i in range(num_microbatches)]

    def loss_ranks(self, num_microbatches: int) -> list[int]:
        """The global ranks where a training step's losses are computed; the last of them holds the
        split's last stage and shares the step's results (the others send theirs to it first)."""
        if self.asynchronous is not None:
            return [self.placement.pipeline_ranks[self.placement.last_position]]
        return loss_ranks(self.schedule(num_microbatches), self.placement.pipeline_ranks)

    def microbatches_for(self, samples: int) -> int:
        """Micro-batches for a batch of ``samples``: ``chunks``, or for interleaving the most it can
        round (a short last batch)."""
        if not self.options.schedule.rounds:
            return self.num_microbatches
        return valid_microbatches(self.num_stages, max(1, min(self.num_microbatches, samples)))

    def schedule(self, num_microbatches: int, forward: bool = False) -> Schedule:
        """The training schedule (with ``forward``, evaluation on its layout) for ``num_microbatches``,
        proven to finish on this process group (raises :class:`~lightning_pipe.schedules.runnable.ScheduleRefused`)."""
        key = (num_microbatches, forward)
        if key not in self._schedules:
            options, placement = self.options, self.placement
            self._schedules[key] = runnable_schedule(
                options.schedule,
                self.num_stages,
                num_microbatches,
                options.virtual_stages,
                placement.rendezvous,
                forward=forward,
            )
        return self._schedules[key]

    # ------------------------------------------------------------------ verbs
    def agree(
        self,
        keys: Sequence[Hashable],
        content: Sequence[Tensor] | None = None,
        source: str | Callable[[], str] = "the DataLoader",
    ) -> None:
        """Start comparing this step's micro-batch ``keys`` (and a checksum of ``content``, the
        batch's tensors, when given) with the other stages'; the next verb waits for the answer
        before its first receive, and raises, naming ``source`` (called only then, if a function),
        where the stages disagree."""
        if self.agreement is None:
            return
        self.agreement.post(keys, content, source)

    def train_step(
        self,
        keys: Sequence[Hashable],
        step: StepFn,
        context: Context = nullcontext,
        pause_after: bool = False,
        stop_after: bool = False,
    ) -> bool:
        """Run one batch of ``len(keys)`` micro-batches (``keys[i]``: micro-batch ``i``'s input
        shapes, alike on every stage) through the training schedule; ``step(i)`` runs the user's
        step for micro-batch ``i``. The gradients are kept for :meth:`hand_over_gradients`.

        An asynchronous schedule runs this batch's forwards and the backwards due now, and drains
        where the pipeline cannot stay full: before this step's update where the rule drains
        (``pause_after``: an epoch ends after this step), after it where training merely stops
        (``stop_after``: ``max_steps``, in the middle of an epoch), as a run going on would have run
        those backwards in its next step. Returns whether the pipeline started or drains in this
        step, so a rank reading the step's results at once waits for no work still in flight
        (always, for synchronous schedules)."""
        if self.asynchronous is not None:
            return self._async_step(self.asynchronous, keys, step, context, pause_after, stop_after)
        if self.elastic is not None:
            self.elastic.restore()  # after a resume: this replica's own weights and optimizer state
        schedule = self.schedule(len(keys))
        saved = swap_grads(self.params, {})
        per_param = reaching(schedule, self.stages) if schedule.chains > 1 else None
        self.gradients.begin(len(keys), per_param)  # this step's count of micro-batches: each expects its gradients
        if self.shards is not None:
            self.shards.begin()
        try:
            with context(), self._accumulation():
                self.executor.run(schedule, keys, self._calls(step))
            self._check_agreement()  # a rank with nothing to receive checks the shapes here
            if self.shards is not None:
                self.shards.finish()  # one reduce-scatter of the step's gradients
        finally:
            self.gradients.take(self.params, saved)
        return True

    def _async_step(
        self,
        run: AsyncPipeline,
        keys: Sequence[Hashable],
        step: StepFn,
        context: Context,
        pause_after: bool,
        stop_after: bool,
    ) -> bool:
        """This batch's forwards and the backwards due now; the gradient kept for this step's
        update is that of an earlier batch."""
        m = len(keys)
        fresh = not run.in_flight
        first = run.step * m
        with context(), self._accumulation():
            t = run.train_step(m, {first + i: key for i, key in enumerate(keys)}, self._calls(step))
            self._check_agreement()
            isolated = run.isolated(m)
            settled = fresh or isolated or pause_after or stop_after
            if isolated or pause_after:  # a step from an empty pipeline too: a drain before it must not move this one
                run.drain(Callbacks(timeline=self.timeline))
            elif stop_after:  # the optimizer's step post-hook drains, so a resumed run equals one that went on
                self._drain_after_update = context
        params = {**dict(self.host.named_parameters()), **self.outside}
        due: dict[nn.Parameter, Tensor | None] = {params[name]: grad for name, grad in run.due(t, m).items()}
        if self.owners is not None:
            self.owners.note(due)
        self.gradients.keep(due)
        return settled

    def evaluate(self, keys: Sequence[Hashable], step: StepFn, context: Context = nullcontext) -> None:
        """Run one batch forward only (``step(i)`` on the last stage once per micro-batch)."""
        with context():
            self.executor.run(self.schedule(len(keys), forward=True), keys, self._calls(step))
        if self.shards is not None:
            self.shards.reshard()
        self._check_agreement()

    def drain(self, context: Context = nullcontext) -> None:
        """Finish an asynchronous schedule's backwards in flight (before evaluation, a checkpoint,
        the end of training); a no-op otherwise."""
        if self.asynchronous is not None and self.asynchronous.in_flight:
            with context(), self._accumulation():
                self.asynchronous.drain(Callbacks(timeline=self.timeline))

    def inexact_drain(self) -> str | None:
        """Why :meth:`drain` would now change the weights an asynchronous schedule's rule gives, or None
        (see :meth:`~lightning_pipe.runtime.async_pipeline.AsyncPipeline.inexact_drain`)."""
        return None if self.asynchronous is None else self.asynchronous.inexact_drain()

    def hand_over_gradients(self, scale: float = 1.0) -> None:
        """Give the kept gradients, summed across ranks where needed and times ``scale``, to the
        parameters (added to what ``.grad`` holds, which may have been zeroed since the step)."""
        self.gradients.hand_over(scale)
        run = self.asynchronous
        if run is not None:  # the optimizer changes the parameters in place next
            if run.stashes:
                run.versions.protect()
            if run.pipemare is not None:
                run.pipemare.before_update()

    def attach_optimizers(self, optimizers: Sequence[Any]) -> None:
        """The user's optimizers, which PipeMare's learning-rate factor and velocity follow, and after
        whose steps elastic averaging pulls the replicas together (a no-op otherwise)."""
        if self.elastic is not None:
            self.elastic.attach(optimizers)
        if self.asynchronous is not None and self.asynchronous.pipemare is not None:
            self.asynchronous.pipemare.attach(optimizers)  # first: its post-hook ends the update
        self._remove_update_hooks()
        if self.asynchronous is not None:
            self._update_hooks = [o.register_step_post_hook(self._after_update) for o in optimizers]

    def _after_update(self, *_: Any) -> None:
        """A stop by ``max_steps`` in the middle of an epoch drains here, after the step's update; under
        PipeMare's rescheduling the stages first take the parameters every stage holds from their users."""
        if self.owners is not None:
            self.owners.hand_out()
        context, self._drain_after_update = self._drain_after_update, None
        if context is not None:
            self.drain(context)

    def _remove_update_hooks(self) -> None:
        for handle in self._update_hooks:
            handle.remove()
        self._update_hooks = []

    def clip_grad_norm_(self, parameters: Sequence[nn.Parameter], max_norm: float) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` with the 2-norm taken over every stage's gradients
        (see :meth:`lightning_pipe.runtime.grads.gradients.StageGradients.clip_grad_norm_`)."""
        return self.gradients.clip_grad_norm_(parameters, max_norm, self.placement.device)

    def state_dict(self) -> dict[str, Any] | None:
        """An asynchronous schedule's state for a checkpoint (drain first); None for synchronous ones.
        With replicas (a collective over them: every rank calls it), ``pending`` is the replicas'
        mean and ``replica_pending`` each replica's own (see :mod:`~lightning_pipe.runtime.replicas.pending`).
        Under elastic averaging (a collective over the replicas too): ``{"elastic": ...}``, the center and
        every replica's own weights and optimizer state."""
        if self.elastic is not None:
            return {"elastic": self.elastic.state_dict(self.placement.stage, self.num_stages, self.placement.replica)}
        if self.asynchronous is None:
            return None
        state = self.asynchronous.state_dict()
        # the parameters every stage holds: each stage's own part, under its own name
        stage, everywhere = self.placement.stage, self._everywhere
        state["pending"] = {b: qualify(g, everywhere, stage) for b, g in state["pending"].items()}
        if "pipemare" in state:
            velocity = qualify(state["pipemare"]["velocity"], everywhere, stage)
            state["pipemare"] = {**state["pipemare"], "velocity": velocity}
        count = self.placement.num_replicas
        if count > 1:
            replicas = gather_pending(state["pending"], self.topology.dp_group, count)
            state["pending"] = mean_pending(replicas)
            state["replica_pending"] = replicas
        return state

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Give this stage its share of an asynchronous schedule's saved state (every stage's, by
        parameter name): this replica's own unapplied gradients where the checkpoint has as many
        replicas, else the saved replicas' mean. Elastic averaging's state: see
        :meth:`~lightning_pipe.runtime.replicas.elastic_averaging.ElasticAverage.load_state_dict`."""
        if self.elastic is not None:
            if state is None or "elastic" not in state:  # saved without elastic averaging
                self.elastic.center_on_loaded_weights()
                return
            p = self.placement
            self.elastic.load_state_dict(state["elastic"], p.stage, p.num_stages, p.replica)
            return
        if self.asynchronous is None or state is None:
            return
        local = {name for name, _ in self.host.named_parameters()} | set(self.outside)
        stage, everywhere = self.placement.stage, self._everywhere
        saved = pending_for(state, self.placement.replica, self.placement.num_replicas)
        pending = {b: unqualify(grads, local, everywhere, stage) for b, grads in saved.items()}
        mine: dict[str, Any] = {"step": state["step"], "pending": pending}
        if "pipemare" in state:
            saved = state["pipemare"]
            mine["pipemare"] = {**saved, "velocity": unqualify(saved["velocity"], local, everywhere, stage)}
        if "delay_correction" in state:
            saved = state["delay_correction"]
            mine["delay_correction"] = {**saved, "buffers": {n: v for n, v in saved["buffers"].items() if n in local}}
        self.asynchronous.load_state_dict(mine)

    def enable_timeline(self, keep: int | None = None) -> Timeline:
        """Record, from the next step on, when each action ran on this rank; callers share one
        timeline, keeping the most steps any of them asked for (None: all)."""
        timeline = self.timeline
        if timeline is None:
            timeline = self.timeline = Timeline(self.placement.device, keep)
        elif timeline.keep is not None:
            timeline.keep = None if keep is None else max(keep, timeline.keep)
        return timeline

    def close(self) -> None:
        """Give the layers back their own forwards and remove the gradient hooks."""
        if self.asynchronous is not None and self.asynchronous.pipemare is not None:
            self.asynchronous.pipemare.detach()
        if self.elastic is not None:
            self.elastic.detach()
        self._remove_update_hooks()
        deferred_conv.uninstall_split(self._fused)
        self._fused = []
        self.gradients.close()

    # ------------------------------------------------------------------ internals
    def _calls(self, step: StepFn) -> Callbacks:
        """What a verb's run of the executor calls out to: the user's step, the agreement's check
        before the first receive (a no-op once done), the timeline."""
        check = self.agreement.check if self.agreement is not None else None
        return Callbacks(step, check, self.timeline)

    def _check_agreement(self) -> None:
        """The agreement's answer, where the verb had no receive to wait for it before."""
        if self.agreement is not None:
            self.agreement.check()

    def _accumulation(self) -> AbstractContextManager[Any]:
        return fused_linear.accumulating(self.options.gradient_accumulation_fusion) if self._fused else nullcontext()
