"""One reconcile pass, as a pure function from what exists to what to do.

Level-triggered: every pass reads the whole picture (the deployment, its groups, the nodes,
the pods holding GPUs) and decides the next safe steps; running it twice changes nothing.
Per pool it restarts broken gangs whole, places missing groups (incrementally, next to the
groups that stay), removes surplus groups choosing those that free whole NVLink domains, and
rolls groups with an outdated template one at a time with one group of surge, so serving
capacity never drops below the desired count while a roll has room to surge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from copse.api import ColdStartStrategy, InferenceDeployment, Phase, Role
from copse.api.v1alpha1 import CordonPolicy, RolloutSpec
from copse.operator import names
from copse.operator.children import (
    GroupLayout,
    Images,
    RoutingIssue,
    changed_fields,
    legacy_template_hash,
    revision,
    routing_issues,
    template_hash,
    template_inputs,
)
from copse.operator.planning import Placer
from copse.operator.state import GroupState, ObservedGroup, pod_ready

#: Unplaced groups named one by one in ``status.unplaced``, the PlacementInfeasible condition and
#: its Event; the rest are counted (``status.unplacedTotal``). Thousands of replicas beyond the
#: cluster's capacity would otherwise write a status of megabytes (etcd refuses objects over
#: 1.5 MB, so every status patch would fail) and an Event as large.
UNPLACED_LISTED = 5


def _unplaced_summary(unplaced: Sequence[Mapping[str, Any]]) -> str:
    listed = "; ".join(f"{u['role']} {u['replica']}: {u['reason']}" for u in unplaced[:UNPLACED_LISTED])
    rest = len(unplaced) - UNPLACED_LISTED
    return f"{listed}; and {rest} more group(s) unplaced" if rest > 0 else listed


@dataclasses.dataclass(frozen=True)
class ReconcileSettings:
    restart_backoff_base_s: float = 2.0
    """First wait before a restarted gang is placed again; doubles per restart, so a gang
    that keeps failing does not thrash the scheduler."""
    restart_backoff_max_s: float = 120.0
    """Longest wait between restarts of one gang."""
    drain_poll_s: float = 1.0
    """How often a draining group's in-flight requests are counted (a GET per router pod): the
    delay between its last request ending and its removal."""
    images: Images = dataclasses.field(default_factory=Images)
    """Images of the pods the operator creates where the manifest names none (the chart's)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclasses.dataclass(kw_only=True)
class Decision:
    """What one pass wants done, in the order the executor does it."""

    restart: list[tuple[ObservedGroup, str]] = dataclasses.field(default_factory=list)
    """Broken gangs: delete all their pods now, count the restart, forget the placement."""
    drain: list[tuple[ObservedGroup, str]] = dataclasses.field(default_factory=list)
    """Serving groups to remove once idle: mark them draining (the router sends them nothing new)."""
    undrain: list[tuple[ObservedGroup, str]] = dataclasses.field(default_factory=list)
    """Draining groups taken back (a scale-up during their drain): unmark them, they serve again."""
    force_delete: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(pod name, why) of pods stuck Terminating on a NotReady node past the grace: delete them
    with no grace (their kubelet will never confirm), so the gang can restart elsewhere."""
    remove: list[tuple[ObservedGroup, str]] = dataclasses.field(default_factory=list)
    """Groups to delete with their Service (idle or drained; scale-down, finished roll)."""
    place: list[GroupLayout] = dataclasses.field(default_factory=list)
    """New placements to record on the group's Service (created if missing)."""
    create_pods: list[GroupLayout] = dataclasses.field(default_factory=list)
    """Groups whose missing pods to create, gated (includes every group in ``place``)."""
    lift_gates: list[ObservedGroup] = dataclasses.field(default_factory=list)
    """Groups whose every pod exists: release the scheduling gates."""
    cold_start_source: str | None = None
    cold_start_ranks: int | None = None
    """GPUs of the cold-start source group when it is one pod (new groups can be pointed at it);
    ``None`` otherwise."""
    events: list[Event] = dataclasses.field(default_factory=list)
    status: dict[str, Any] = dataclasses.field(default_factory=dict)
    requeue_after_s: float | None = None
    """Come back this soon even without a watch event (backoff expiry, a roll step)."""


#: States in which a group holds (or is about to hold) its planned nodes.
_HOLDING = frozenset({GroupState.PLANNED, GroupState.GATED, GroupState.STARTING, GroupState.READY})


def _clock(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds")


def _backoff_s(group: ObservedGroup, settings: ReconcileSettings) -> float:
    if group.restarts == 0:
        return 0.0
    return float(
        min(settings.restart_backoff_max_s, settings.restart_backoff_base_s * 2 ** (group.restarts - 1))
    )


def _free_indices(taken: set[int], count: int) -> list[int]:
    """The lowest ``count`` replica indices not in use (names must not collide with a group
    still terminating)."""
    return [index for index in range(len(taken) + count) if index not in taken][:count]


def _cold_start_source(deployment: InferenceDeployment, groups: Sequence[ObservedGroup]) -> str | None:
    cold_start = deployment.spec.cold_start
    if cold_start.strategy is ColdStartStrategy.NONE:
        return None
    ready = [group.name for group in groups if group.state is GroupState.READY]
    if cold_start.source_replica == "any-healthy":
        return ready[0] if ready else None
    return cold_start.source_replica if cold_start.source_replica in ready else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class _NodeTrouble:
    broken: dict[tuple[Role, int], str]
    """Groups that cannot run where they are any more, with the reason: restart them whole."""
    waiting: dict[str, str]
    """Group name -> the NotReady node it waits out, and until when."""
    cordoned: dict[str, str]
    """Group name -> the cordoned node under it, and what happens to it."""
    waits: list[float]
    """Seconds until each wait ends (the pass requeues itself for the first)."""


def _node_trouble(
    *, deployment: InferenceDeployment, placer: Placer, holding: Sequence[GroupLayout], now: datetime
) -> _NodeTrouble:
    """What the nodes under the groups that hold a placement mean for them: a gone node or an
    evicting taint breaks a gang now, a NotReady one after the grace, a cordon never."""
    name = deployment.metadata.name
    broken = placer.invalid(holding)
    moves = deployment.spec.disruption.on_cordon is CordonPolicy.MOVE
    cordoned = {
        names.group_name(name, *key): f"node {node} is cordoned: the group moves whole (its successor "
        "is placed elsewhere first, then it drains)"
        if moves
        else f"node {node} is cordoned: the group keeps running there, no new pods land on it"
        for key, node in placer.cordoned(holding).items()
    }
    waiting: dict[str, str] = {}
    waits: list[float] = []
    grace = deployment.spec.disruption.not_ready_grace_s
    for key, (node, since) in placer.unready(holding).items():
        if key in broken:
            continue
        moves_at = since + grace
        if now.timestamp() >= moves_at:
            down_for = now.timestamp() - since
            broken[key] = f"node {node} has been NotReady for {down_for:.0f}s (grace {grace:g}s)"
        else:
            # Level-triggered: come back when the grace ends, in case nothing else happens by then.
            waits.append(moves_at - now.timestamp())
            waiting[names.group_name(name, *key)] = (
                f"node {node} NotReady since {_clock(since)}; the gang restarts elsewhere at "
                f"{_clock(moves_at)} unless the node recovers"
            )
    return _NodeTrouble(broken=broken, waiting=waiting, cordoned=cordoned, waits=waits)


def _stuck_pods(
    *, terminating: Sequence[ObservedGroup], placer: Placer, grace_s: float, now: datetime
) -> tuple[list[tuple[str, str]], list[float]]:
    """Pods of terminating groups that wait on a NotReady node: force-delete those whose node has
    been down for the grace (a dead kubelet never confirms a deletion), and when the others are due."""
    stuck: list[tuple[str, str]] = []
    waits: list[float] = []
    for group in terminating:
        for pod in group.pods.values():
            node = pod.get("spec", {}).get("nodeName")
            meta = pod.get("metadata", {})
            # Grace 0 already: force-deleted (only finalizers, not a kubelet, hold it now).
            if not meta.get("deletionTimestamp") or meta.get("deletionGracePeriodSeconds") == 0 or not node:
                continue
            since = placer.not_ready_since(node)
            if since is None:
                continue
            due = since + grace_s - now.timestamp()
            if due > 0:
                waits.append(due)
                continue
            stuck.append(
                (
                    pod["metadata"]["name"],
                    f"stuck Terminating on node {node}, NotReady for {now.timestamp() - since:.0f}s "
                    f"(grace {grace_s:g}s)",
                )
            )
    return stuck, waits


@dataclasses.dataclass(frozen=True, kw_only=True)
class _RollStep:
    retire: list[ObservedGroup]
    """Old groups to retire now (drained first when serving)."""
    budget: int
    """New groups the pool may place this pass (filling what it lacks first, then surging)."""
    wanted: int
    """New groups the roll still needs in all."""


def _roll_step(
    *,
    rollout: RolloutSpec,
    moving: set[str],
    desired: int,
    remaining: Sequence[ObservedGroup],
    outdated: Callable[[ObservedGroup], bool],
    draining: int,
    keep_last_old: bool,
    unroutable: Collection[str],
) -> _RollStep:
    """One step of a roll of a pool within ``spec.rollout``: retire old groups while the pool keeps
    ``desired - maxUnavailable`` ready groups (idle old ones first: they serve nothing), and place
    new ones while it holds at most ``desired + maxSurge`` groups (draining ones included: they
    still hold their GPUs), never touching the ``partition`` groups a canary keeps old.
    ``keep_last_old``: the last ready old group stays (the old revision's last P/D pair).
    ``moving``: groups leaving a cordoned node; they count as old, but no partition keeps them.
    ``unroutable``: ready groups some router does not use yet; new ones count as not ready, so no
    old group goes for them before the routers can send them requests.
    Level-triggered: a revert or a second change mid-roll is another set of outdated groups under
    the same bounds."""
    old = [g for g in remaining if outdated(g) and g.state is not GroupState.BROKEN]
    fresh = [g for g in remaining if not outdated(g)]
    keep_old = min(rollout.partition, desired)

    def serving(group: ObservedGroup) -> bool:
        """Ready, and for a new group also used by every router (an old one counts as it is)."""
        return group.state is GroupState.READY and (outdated(group) or group.name not in unroutable)

    ready = sum(1 for g in remaining if serving(g))
    old_ready = sum(1 for g in old if serving(g))
    floor = desired - rollout.max_unavailable
    retire: list[ObservedGroup] = []
    stale = sum(1 for g in old if g.name not in moving)
    for group in sorted(old, key=lambda g: (g.name not in moving, serving(g))):
        if group.name not in moving and stale <= keep_old:
            continue
        if serving(group):
            if ready - 1 < floor or (old_ready == 1 and keep_last_old):
                break
            ready -= 1
            old_ready -= 1
        if group.name not in moving:
            stale -= 1
        retire.append(group)
    held = len(remaining) + draining
    return _RollStep(
        retire=retire,
        budget=max(0, desired + rollout.max_surge - held),
        wanted=max(0, desired - min(keep_old, sum(1 for g in old if g.name not in moving)) - len(fresh)),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Drained:
    remove: list[tuple[ObservedGroup, str]]
    """Draining groups that are idle now, or out of time."""
    events: list[Event]
    """One per removed group, in the same order."""
    messages: dict[str, str]
    """Group name -> how its drain stands (for its status entry)."""
    waits: list[float]


def _drained(
    *,
    deployment: InferenceDeployment,
    draining: Sequence[ObservedGroup],
    in_flight: Mapping[str, int | None],
    now: datetime,
    settings: ReconcileSettings,
) -> _Drained:
    """Which draining groups to remove now: those with no request in flight on any router, and
    those whose drain timeout is over (an unknown count waits for the timeout)."""
    timeout = deployment.spec.disruption.drain_timeout_s
    remove: list[tuple[ObservedGroup, str]] = []
    events: list[Event] = []
    messages: dict[str, str] = {}
    waits: list[float] = []
    for group in draining:
        since = (group.draining_since or now).timestamp()
        deadline = since + timeout
        count = in_flight.get(group.name)
        took = f"after {now.timestamp() - since:.0f}s"
        if count == 0:
            outcome = f"drained {took}"
        elif now.timestamp() >= deadline:
            left = "an unknown number of" if count is None else str(count)
            outcome = f"drain timeout ({timeout:g}s) with {left} requests still in flight"
        else:
            waits.append(min(settings.drain_poll_s, deadline - now.timestamp()))
            counted = "requests in flight unknown yet" if count is None else f"{count} requests in flight"
            messages[group.name] = (
                f"draining before removal ({group.reason}): no new requests, {counted}; "
                f"removed by {_clock(deadline)} at the latest"
            )
            continue
        remove.append((group, f"{group.reason}, {outcome}"))
        kind = "Normal" if count == 0 else "Warning"
        events.append(
            Event(type=kind, reason="Drained", message=f"group {group.name}: {outcome}; removing it")
        )
    return _Drained(remove=remove, events=events, messages=messages, waits=waits)


def reconcile(
    *,
    deployment: InferenceDeployment,
    groups: Sequence[ObservedGroup],
    nodes: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    now: datetime,
    generation: int | None = None,
    previous_status: Mapping[str, Any] | None = None,
    in_flight: Mapping[str, int | None] | None = None,
    unroutable: Collection[str] = frozenset(),
    settings: ReconcileSettings = ReconcileSettings(),
) -> Decision:
    """Decide the next steps for ``deployment``; ``pods`` are all pods that may hold GPUs;
    ``in_flight``: requests the routers still have on each draining group (None: unknown);
    ``unroutable``: ready groups some router does not use yet (a roll does not count them)."""
    decision = Decision()
    name = deployment.metadata.name
    terminating = [group for group in groups if group.state is GroupState.TERMINATING]
    live = [group for group in groups if group.state is not GroupState.TERMINATING]
    # Draining groups are on their way out: not part of any pool, their GPUs still taken.
    draining = [group for group in live if group.state is GroupState.DRAINING]
    live = [group for group in live if group.state is not GroupState.DRAINING]
    kept = [g for g in live if g.layout is not None and g.state is not GroupState.BROKEN]
    placer = Placer(deployment=deployment, nodes=nodes, pods=pods, staying=[g.name for g in kept])
    holding = [g.layout for g in live if g.layout is not None and g.state in _HOLDING]
    trouble = _node_trouble(deployment=deployment, placer=placer, holding=holding, now=now)
    invalid = trouble.broken
    waits = list(trouble.waits)
    decision.force_delete, stuck_waits = _stuck_pods(
        terminating=terminating, placer=placer, grace_s=deployment.spec.disruption.not_ready_grace_s, now=now
    )
    waits += stuck_waits
    decision.events += [
        Event(type="Warning", reason="ForceDeleted", message=f"pod {pod}: {why}; deleted with no grace")
        for pod, why in decision.force_delete
    ]
    disruptions = {**trouble.cordoned, **trouble.waiting}
    """Group name -> why it is not serving normally (for its status entry)."""
    live = [
        dataclasses.replace(g, state=GroupState.BROKEN, reason=invalid[(g.role, g.replica)])
        if (g.role, g.replica) in invalid and g.state in _HOLDING
        else g
        for g in live
    ]
    drained = _drained(
        deployment=deployment, draining=draining, in_flight=in_flight or {}, now=now, settings=settings
    )
    waits += drained.waits
    taken_back: set[str] = set()
    """Draining groups a scale-up takes back this pass."""
    drain_timeout = deployment.spec.disruption.drain_timeout_s

    def retire(group: ObservedGroup, reason: str) -> None:
        """A serving group drains first (unless draining is off); any other goes at once."""
        if group.state is GroupState.READY and drain_timeout > 0:
            decision.drain.append((group, reason))
        else:
            decision.remove.append((group, reason))

    to_place: list[tuple[Role, int]] = []
    staying: list[ObservedGroup] = []
    moving = set(trouble.cordoned) if deployment.spec.disruption.on_cordon is CordonPolicy.MOVE else set()
    """Groups on cordoned nodes that move whole: rolled like outdated ones, whatever the partition."""
    accepted_by_role = {
        pool.role: {template_hash(deployment, pool.role), legacy_template_hash(deployment, pool.role)}
        for pool in deployment.spec.pools()
    }
    ready_by_role = {
        role: [g for g in live if g.role is role and g.state is GroupState.READY and g.layout is not None]
        for role in accepted_by_role
    }
    # P/D coherence: the last ready old group of a role stays while the old revision still serves
    # with the other role, unless the new revision has a routable pair (or this is not P/D); the old
    # revision's last decode group outlasts its prefill groups even then, so no revision is ever left
    # with prefill it cannot pair.
    new_pair = all(
        any(g.template_hash in accepted_by_role[role] and g.name not in unroutable for g in ready)
        for role, ready in ready_by_role.items()
    )
    old_ready_other = {
        role: any(
            g.template_hash not in accepted_by_role[other]
            for other, ready in ready_by_role.items()
            if other is not role
            for g in ready
        )
        for role in accepted_by_role
    }

    for pool in deployment.spec.pools():
        accepted = accepted_by_role[pool.role]
        slots = [group for group in live if group.role is pool.role]
        for group in slots:
            if group.state is GroupState.BROKEN:
                decision.restart.append((group, group.reason))
                decision.events.append(
                    Event(
                        type="Warning",
                        reason="GangRestart",
                        message=f"restarting group {group.name}: {group.reason}",
                    )
                )

        def outdated(group: ObservedGroup, accepted: set[str] = accepted) -> bool:
            return group.layout is not None and (group.template_hash not in accepted or group.name in moving)

        rollout = deployment.spec.rollout
        keep_old = min(rollout.partition, pool.replicas)
        stale = sum(1 for group in slots if outdated(group) and group.name not in moving)
        rolling = (not rollout.paused and stale > keep_old) or any(g.name in moving for g in slots)
        # While rolling, up to max_surge groups above the replicas are the roll's, not surplus.
        surplus = len(slots) - pool.replicas - (rollout.max_surge if rolling else 0)
        removable = sorted(
            slots,
            key=lambda group: (
                group.state not in {GroupState.UNPLACED, GroupState.BROKEN},
                group.state is GroupState.READY,
                not outdated(group),
            ),
        )
        removed: list[ObservedGroup] = []
        if surplus > 0:
            # Groups that serve nothing go first; among serving ones the placement engine
            # picks those whose removal frees whole domains.
            idle = [g for g in removable if g.state is not GroupState.READY][:surplus]
            serving = {g.replica: g for g in slots if g.state is GroupState.READY and g not in idle}
            picked = placer.victims(
                role=pool.role,
                layouts=[g.layout for g in serving.values() if g.layout is not None],
                count=surplus - len(idle),
            )
            chosen = idle + [serving[replica] for replica in picked]
            removed += chosen
            for group in chosen:
                retire(group, "scale-down")
        remaining = [group for group in slots if group not in removed]

        surge = 0
        budget: int | None = None
        """New groups the roll lets this pool place this pass (None: not rolling, no bound)."""
        if rolling:
            step = _roll_step(
                rollout=rollout,
                moving=moving,
                desired=pool.replicas,
                remaining=remaining,
                outdated=outdated,
                draining=sum(1 for g in draining if g.role is pool.role),
                keep_last_old=old_ready_other[pool.role] and (not new_pair or pool.role is Role.DECODE),
                unroutable=unroutable,
            )
            for victim in step.retire:
                removed.append(victim)
                remaining.remove(victim)
                if victim.name in moving:
                    retire(victim, "moved off a cordoned node")
                    decision.events.append(
                        Event(
                            type="Normal",
                            reason="Moved",
                            message=f"group {victim.name} leaves its cordoned node: its successor serves",
                        )
                    )
                else:
                    retire(victim, "rolled to the new template")
            lacking = max(0, pool.replicas - len(remaining))
            budget = step.budget
            surge = max(0, min(budget, step.wanted) - min(lacking, budget))
            if (surge or step.retire) and stale:
                old = [g for g in slots if outdated(g) and g.name not in moving]
                inputs = template_inputs(deployment, pool.role)
                fields = changed_fields(old[0].template, inputs) if old[0].template is not None else []
                because = ", ".join(fields) if fields else "a template made by an older operator"
                decision.events.append(
                    Event(
                        type="Normal",
                        reason="RollingUpdate",
                        message=f"{pool.role.value}: {surge} new group(s) surging, "
                        f"{len(step.retire)} group(s) retiring, {len(old)} of an old template "
                        f"(changed: {because})",
                    )
                )
        if surge:
            taken = {g.replica for g in groups if g.role is pool.role}
            to_place += [(pool.role, index) for index in _free_indices(taken, surge)]

        missing = pool.replicas - len(remaining)
        if budget is not None:
            missing = min(missing, budget)  # a roll without surge room waits for the drains
        if missing > 0:
            # A scale-up during a drain takes the draining groups back before placing new ones:
            # they are warm, placed, and of the current template.
            back = [
                g
                for g in draining
                if g.role is pool.role
                and g.template_hash in accepted
                and g.pods
                and all(pod_ready(pod) for pod in g.pods.values())
            ][:missing]
            for group in back:
                taken_back.add(group.name)
                decision.undrain.append((group, "scale-up"))
                remaining.append(dataclasses.replace(group, state=GroupState.READY, reason=""))
                decision.events.append(
                    Event(
                        type="Normal",
                        reason="DrainCancelled",
                        message=f"group {group.name} serves again: the pool grew back during its drain",
                    )
                )
            missing -= len(back)
        for group in remaining:
            if group.state is GroupState.UNPLACED:
                wait = (
                    (group.last_restart.timestamp() + _backoff_s(group, settings) - now.timestamp())
                    if group.last_restart
                    else 0.0
                )
                if wait > 0:
                    waits.append(wait)
                else:
                    to_place.append((group.role, group.replica))
        if missing > 0:
            taken = {g.replica for g in groups if g.role is pool.role}
            taken |= {replica for role, replica in to_place if role is pool.role}
            to_place += [(pool.role, index) for index in _free_indices(taken, missing)]
        staying += [g for g in remaining if g.state not in {GroupState.UNPLACED, GroupState.BROKEN}]

    for (group, why), event in zip(drained.remove, drained.events, strict=True):
        if group.name not in taken_back:
            decision.remove.append((group, why))
            decision.events.append(event)
    disruptions.update({g: why for g, why in drained.messages.items() if g not in taken_back})
    draining = [g for g in draining if g.name not in taken_back]
    restarting = {group.name for group, _ in decision.restart}
    for group in staying:
        if group.name in restarting:
            continue
        if group.state is GroupState.PLANNED and group.layout is not None:
            decision.create_pods.append(group.layout)
        elif group.state is GroupState.GATED:
            decision.lift_gates.append(group)

    # A group retired this pass still holds its GPUs until its pods are gone, but the placer left
    # its pods out (it was staying when the placer was built): it is placed as existing, or a group
    # placed now could land on its GPUs and be restarted by the next pass.
    retired = {group.name for group, _ in (*decision.drain, *decision.remove)}
    outcome = placer.place(
        requests=to_place,
        existing=[
            g.layout
            for g in (*staying, *(g for g in kept if g.name in retired))
            if g.layout is not None and g.name not in restarting
        ],
    )
    decision.place = list(outcome.placed)
    decision.create_pods += outcome.placed
    for layout in outcome.placed:
        where = f"domain {layout.domain}" if layout.domain else "several domains"
        nodes_text = ", ".join(f"{node}×{gpus}" for node, gpus in layout.pods)
        decision.events.append(
            Event(
                type="Normal",
                reason="Placed",
                message=f"group {names.group_name(name, layout.role, layout.replica)} on {where} "
                f"({nodes_text}), cost {layout.cost:.3f}",
            )
        )
    unplaced = [
        {"role": role.value, "replica": replica, "reason": reason}
        for role, replica, reason in outcome.unplaced
    ]
    previous = previous_status or {}
    if unplaced and (unplaced[:UNPLACED_LISTED], len(unplaced)) != (
        list(previous.get("unplaced", [])),
        previous.get("unplacedTotal", len(previous.get("unplaced", []))),
    ):
        decision.events.append(
            Event(type="Warning", reason="PlacementInfeasible", message=_unplaced_summary(unplaced))
        )
    before = {g.get("name"): g.get("disruption") for g in previous.get("groups", [])}
    for group_name, message in sorted(trouble.waiting.items()):
        if before.get(group_name) != message:
            decision.events.append(
                Event(type="Warning", reason="NodeNotReady", message=f"group {group_name}: {message}")
            )
    issues = routing_issues(deployment)
    routing_message = "; ".join(issue.message for issue in issues)
    routing_before = next((c for c in previous.get("conditions", []) if c.get("type") == "KVRouting"), None)
    if issues and (
        routing_before is None
        or routing_before.get("status") != "False"
        or routing_before.get("message") != routing_message
    ):
        decision.events.append(Event(type="Warning", reason="KVRoutingDegraded", message=routing_message))
    decision.cold_start_source = _cold_start_source(deployment, live)
    source = next((group for group in live if group.name == decision.cold_start_source), None)
    if source is not None and source.layout is not None and len(source.layout.pods) == 1:
        decision.cold_start_ranks = source.layout.pods[0][1]
    decision.status = _status(
        deployment=deployment,
        groups=[g for g in staying if g.name not in restarting],
        draining=[g for g in draining if g not in [group for group, _ in drained.remove]],
        placed=outcome.placed,
        unplaced=unplaced,
        restarting=[g for g, _ in decision.restart],
        disruptions=disruptions,
        cold_start_source=decision.cold_start_source,
        placer=placer,
        now=now,
        generation=generation,
        previous_conditions=previous.get("conditions", []),
        routing=issues,
        accepted=accepted_by_role,
    )
    acting = (
        decision.restart
        or decision.drain
        or decision.undrain
        or decision.force_delete
        or decision.remove
        or decision.place
        or decision.lift_gates
    )
    if waits:
        decision.requeue_after_s = min(waits)
    elif acting:
        decision.requeue_after_s = 1.0
    return decision


def condition(
    kind: str,
    ok: bool,
    *,
    reason: str,
    message: str,
    generation: int | None,
    now: datetime,
    previous: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = next((c for c in previous if c.get("type") == kind), None)
    # The transition time moves only when the status does, as Kubernetes conditions expect.
    since = before["lastTransitionTime"] if before and before.get("status") == status else now.isoformat()
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def _status(
    *,
    deployment: InferenceDeployment,
    groups: Sequence[ObservedGroup],
    draining: Sequence[ObservedGroup],
    placed: Sequence[GroupLayout],
    unplaced: list[dict[str, Any]],
    restarting: Sequence[ObservedGroup],
    disruptions: Mapping[str, str],
    cold_start_source: str | None,
    placer: Placer,
    now: datetime,
    generation: int | None,
    previous_conditions: Sequence[Mapping[str, Any]],
    routing: Sequence[RoutingIssue],
    accepted: Mapping[Role, set[str]],
) -> dict[str, Any]:
    """``accepted``: per role, the template hashes that count as current."""
    name = deployment.metadata.name
    layouts = [g.layout for g in groups if g.layout is not None] + list(placed)
    ready_names = {g.name for g in groups if g.state is GroupState.READY}
    roles: dict[str, dict[str, int]] = {}
    desired_total = ready_total = 0
    for pool in deployment.spec.pools():
        role_layouts = [layout for layout in layouts if layout.role is pool.role]
        ready = sum(1 for g in groups if g.role is pool.role and g.name in ready_names)
        updated = [
            g
            for g in groups
            if g.role is pool.role and (g.layout is None or g.template_hash in accepted[pool.role])
        ]
        updated_count = len(updated) + sum(1 for layout in placed if layout.role is pool.role)
        roles[pool.role.value] = {
            "desired": pool.replicas,
            "placed": len(role_layouts),
            "ready": ready,
            "updated": updated_count,
            "updatedReady": sum(1 for g in updated if g.name in ready_names),
            "old": sum(1 for g in groups if g.role is pool.role) - len(updated),
        }
        desired_total += pool.replicas
        ready_total += min(ready, pool.replicas)
    placed_total = sum(min(r["placed"], r["desired"]) for r in roles.values())
    if ready_total >= desired_total:
        phase = Phase.RUNNING
    elif unplaced or restarting:
        phase = (
            Phase.DEGRADED
            if ready_total > 0
            else (Phase.FAILED if unplaced and not layouts else Phase.PLACING)
        )
    elif layouts:
        phase = Phase.PLACING
    else:
        phase = Phase.PENDING
    evaluation = placer.evaluate(layouts, unplaced=[(Role(u["role"]), int(u["replica"])) for u in unplaced])
    groups_status = []
    for scored in sorted(evaluation.groups, key=lambda item: (item.role, item.replica)):
        group = names.group_name(name, Role(scored.role), scored.replica)
        entry = {
            "name": group,
            "role": scored.role,
            "replica": scored.replica,
            "domain": scored.domain,
            "rack": scored.rack,
            "pods": [{"node": pod.node, "gpus": pod.gpus} for pod in scored.pods],
            "cost": round(scored.cost.total, 3),
            "ready": group in ready_names,
        }
        if group in disruptions:
            entry["disruption"] = disruptions[group]
        groups_status.append(entry)
    for leaving in draining:
        if leaving.layout is None:
            continue
        entry = {
            "name": leaving.name,
            "role": leaving.role.value,
            "replica": leaving.replica,
            "domain": leaving.layout.domain,
            "rack": leaving.layout.rack,
            "pods": [{"node": node, "gpus": gpus} for node, gpus in leaving.layout.pods],
            "cost": round(leaving.layout.cost, 3),
            "ready": False,
        }
        if leaving.name in disruptions:
            entry["disruption"] = disruptions[leaving.name]
        groups_status.append(entry)
    groups_status.sort(key=lambda entry: (entry["role"], entry["replica"]))
    all_placed, all_ready = placed_total >= desired_total, ready_total >= desired_total
    infeasible = _unplaced_summary(unplaced)
    checks = (
        ("Placed", all_placed, "AllGroupsPlaced" if all_placed else "GroupsUnplaced",
         f"{placed_total}/{desired_total} groups placed"),
        ("Ready", all_ready, "AllGroupsReady" if all_ready else "GroupsNotReady",
         f"{ready_total}/{desired_total} groups ready"),
        ("PlacementInfeasible", bool(unplaced), "NotEnoughCapacity" if unplaced else "Feasible",
         infeasible or "every group fits"),
        # Settings that defeat KV-aware routing: accepted as written, reported here and as an Event.
        ("KVRouting", not routing, routing[0].reason if routing else "Supported",
         "; ".join(issue.message for issue in routing) or "engines and router support KV-aware routing"),
    )  # fmt: skip
    conditions = [
        condition(kind, ok, reason=reason, message=message, generation=generation, now=now,
                   previous=previous_conditions)
        for kind, ok, reason, message in checks
    ]  # fmt: skip
    # The scale subresource's replicas: aggregated groups whose rank-0 pod exists, which is what
    # its selector selects (surge and draining groups included, as a Deployment counts its pods).
    leaders = [g.pods[0] for g in groups if g.role is Role.WORKER and 0 in g.pods]
    scaled = sum(1 for pod in leaders if not pod.get("metadata", {}).get("deletionTimestamp"))
    return {
        "phase": phase.value,
        "observedGeneration": generation,
        "conditions": conditions,
        "roles": roles,
        "ready": ", ".join(f"{role} {r['ready']}/{r['desired']}" for role, r in roles.items()),
        "replicas": scaled,
        "selector": names.scale_selector_string(name),
        "score": round(evaluation.score, 4) if layouts else None,
        "revision": revision(deployment),
        "groups": groups_status,
        "unplaced": unplaced[:UNPLACED_LISTED],
        "unplacedTotal": len(unplaced),
        "coldStart": {"strategy": deployment.spec.cold_start.strategy.value, "source": cold_start_source},
    }
