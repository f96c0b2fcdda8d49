"""The schedule a pipeline step executes, proven to finish on its process group's backend.

Pure (no processes): the pipeline asks for a schedule per micro-batch count, and this module
builds it, regroups its communication where point-to-point calls rendezvous (NCCL), validates it,
and refuses what cannot run with the reason and what to change.
"""

from __future__ import annotations

from lightning_pipe.schedules.actions import Schedule
from lightning_pipe.schedules.families.chimera import chimera_forward
from lightning_pipe.schedules.families.sync import forward_only, forward_only_like
from lightning_pipe.schedules.from_traits import schedule_for
from lightning_pipe.schedules.rendezvous import RendezvousError, for_rendezvous, in_sending_order
from lightning_pipe.schedules.text import forward_like_text
from lightning_pipe.schedules.traits import TRAITS, ScheduleTraits
from lightning_pipe.schedules.validate import InvalidScheduleError, validate


class ScheduleRefused(ValueError):
    """A schedule that cannot run with these stages, micro-batches and backend; the message says
    what to change."""


def runnable_schedule(
    training: ScheduleTraits,
    stages: int,
    num_microbatches: int,
    virtual_stages: int,
    rendezvous: bool,
    forward: bool = False,
) -> Schedule:
    """The ``training`` schedule (with ``forward``, evaluation on its layout) for ``num_microbatches``,
    validated; with ``rendezvous`` (NCCL, whose point-to-point calls rendezvous) with its communication
    regrouped where it needs it."""
    p, v = stages, virtual_stages
    under = " under NCCL (whose point-to-point calls rendezvous)" if rendezvous else ""
    least, text, name = training.min_chunks, training.text, training.name
    if not forward and least is not None and num_microbatches < least(p):
        try:
            schedule_for(training, p, num_microbatches, v)
        except ValueError as err:  # the schedule's own message names the smallest valid chunks
            raise ScheduleRefused(str(err)) from err
    try:
        if not forward:
            schedule = schedule_for(training, p, num_microbatches, v, rendezvous=rendezvous)
        elif text is not None:  # evaluation on the text's stages, any count
            schedule = forward_like_text(text, num_microbatches, rendezvous)
        elif training.mirrored:  # evaluation through one of Chimera's two pipelines
            schedule = chimera_forward(p, num_microbatches)
        elif training.virtual_stages > 1:  # evaluation on the training layout (ZB-V's order: any count)
            layout = TRAITS["zbv"] if training.placement == "v" else training
            schedule = forward_only_like(schedule_for(layout, p, num_microbatches, v))
            if rendezvous and training.regroup_for_rendezvous:
                schedule = for_rendezvous(schedule)
        else:
            schedule = forward_only(p, num_microbatches)
        if rendezvous:  # NCCL pairs messages in posting order: each group's receives as their senders send
            schedule = in_sending_order(schedule)
        validate(schedule, rendezvous=rendezvous)
    except (RendezvousError, InvalidScheduleError) as err:
        if text is not None and not forward and rendezvous:
            raise ScheduleRefused(
                f"schedule text {text.name!r} with {num_microbatches} of its {text.num_microbatches} micro-batches "
                f"cannot run{under}: {err}. Where point-to-point calls rendezvous, each two ranks post the messages "
                "between them in one order and a rank may wait for its own output to come back around the pipeline: "
                "order the text so that every two ranks take the micro-batches they exchange in the same order"
                + (
                    ", drop_last=True in the DataLoader for a short last batch"
                    if num_microbatches < text.num_microbatches
                    else ""
                )
                + ", or run under gloo, which pairs each message with its micro-batch."
            ) from err
        if isinstance(err, InvalidScheduleError):
            raise ScheduleRefused(
                f"schedule={name!r} with {p} processes and {num_microbatches} micro-batches cannot "
                f"run{under}: {err}. Use schedule='1f1b' or 'zero_bubble', or other chunks."
            ) from err
        raise ScheduleRefused(
            f"schedule={name!r} with {p} processes and {num_microbatches} micro-batches cannot run{under}: {err}. "
            "With this few micro-batches a process waits for its own output to come back around the pipeline. Use "
            f"other chunks (checked: >= {p} for 'interleaved_1f1b', a multiple of {p} for 'interleaved_zero_bubble', "
            f">= {max(1, 2 * p - 2)} for 'zbv', >= {max(1, 2 * p - 4)} for 'chimera'; with a short last batch, "
            "drop_last=True in the DataLoader), or schedule='1f1b' or 'zero_bubble'."
        ) from err
    return schedule
