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
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from copse.api import ColdStartStrategy, InferenceDeployment, Phase, Role
from copse.operator import names
from copse.operator.children import GroupLayout, Images, RoutingIssue, routing_issues, template_hash
from copse.operator.planning import Placer
from copse.operator.state import GroupState, ObservedGroup


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
    """Group name -> the cordoned node it keeps running on."""
    waits: list[float]
    """Seconds until each wait ends (the pass requeues itself for the first)."""


def _node_trouble(
    *, deployment: InferenceDeployment, placer: Placer, holding: Sequence[GroupLayout], now: datetime
) -> _NodeTrouble:
    """What the nodes under the groups that hold a placement mean for them: a gone node or an
    evicting taint breaks a gang now, a NotReady one after the grace, a cordon never."""
    name = deployment.metadata.name
    broken = placer.invalid(holding)
    cordoned = {
        names.group_name(name, *key): f"node {node} is cordoned: the group keeps running there, "
        "no new pods land on it"
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Drained:
    remove: list[tuple[ObservedGroup, str]]
    """Draining groups that are idle now, or out of time."""
    events: list[Event]
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
    settings: ReconcileSettings = ReconcileSettings(),
) -> Decision:
    """Decide the next steps for ``deployment``; ``pods`` are all pods that may hold GPUs;
    ``in_flight``: requests the routers still have on each draining group (None: unknown)."""
    decision = Decision()
    name = deployment.metadata.name
    live = [group for group in groups if group.state is not GroupState.TERMINATING]
    # Draining groups are on their way out: not part of any pool, their GPUs still taken.
    draining = [group for group in live if group.state is GroupState.DRAINING]
    live = [group for group in live if group.state is not GroupState.DRAINING]
    placer = Placer(
        deployment=deployment,
        nodes=nodes,
        pods=pods,
        staying=[g.name for g in live if g.layout is not None and g.state is not GroupState.BROKEN],
    )
    holding = [g.layout for g in live if g.layout is not None and g.state in _HOLDING]
    trouble = _node_trouble(deployment=deployment, placer=placer, holding=holding, now=now)
    invalid = trouble.broken
    waits = list(trouble.waits)
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
    decision.remove += drained.remove
    decision.events += drained.events
    waits += drained.waits
    disruptions.update(drained.messages)
    drain_timeout = deployment.spec.disruption.drain_timeout_s

    def retire(group: ObservedGroup, reason: str) -> None:
        """A serving group drains first (unless draining is off); any other goes at once."""
        if group.state is GroupState.READY and drain_timeout > 0:
            decision.drain.append((group, reason))
        else:
            decision.remove.append((group, reason))

    to_place: list[tuple[Role, int]] = []
    staying: list[ObservedGroup] = []

    for pool in deployment.spec.pools():
        current = template_hash(deployment, pool.role)
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

        def outdated(group: ObservedGroup, current: str = current) -> bool:
            return group.layout is not None and group.template_hash != current

        rolling = any(outdated(group) for group in slots)
        surplus = len(slots) - pool.replicas - (1 if rolling else 0)
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

        if rolling and surplus <= 0:
            fresh_ready = sum(1 for g in remaining if not outdated(g) and g.state is GroupState.READY)
            old = [g for g in remaining if outdated(g)]
            if len(remaining) > pool.replicas and fresh_ready >= len(remaining) - len(old):
                # The surge group is up: retire one outdated group.
                victim = sorted(old, key=lambda g: g.state is GroupState.READY)[0]
                removed.append(victim)
                remaining.remove(victim)
                retire(victim, "rolled to the new template")
            elif (
                len(remaining) <= pool.replicas
                and all(g.state is GroupState.READY for g in remaining)
                and not any(g.role is pool.role for g in draining)
            ):
                # One group of surge at a time: the next comes once the last old one is gone.
                [surge] = _free_indices({g.replica for g in groups if g.role is pool.role}, 1)
                to_place.append((pool.role, surge))
                decision.events.append(
                    Event(
                        type="Normal",
                        reason="RollingUpdate",
                        message=f"{pool.role.value}: surging one group to replace {old[0].name}",
                    )
                )

        missing = pool.replicas - len(remaining)
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

    restarting = {group.name for group, _ in decision.restart}
    for group in staying:
        if group.name in restarting:
            continue
        if group.state is GroupState.PLANNED and group.layout is not None:
            decision.create_pods.append(group.layout)
        elif group.state is GroupState.GATED:
            decision.lift_gates.append(group)

    outcome = placer.place(
        requests=to_place,
        existing=[g.layout for g in staying if g.layout is not None and g.name not in restarting],
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
    if unplaced and unplaced != list(previous.get("unplaced", [])):
        decision.events.append(
            Event(
                type="Warning",
                reason="PlacementInfeasible",
                message="; ".join(f"{u['role']} {u['replica']}: {u['reason']}" for u in unplaced),
            )
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
    )
    acting = decision.restart or decision.drain or decision.remove or decision.place or decision.lift_gates
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
) -> dict[str, Any]:
    name = deployment.metadata.name
    layouts = [g.layout for g in groups if g.layout is not None] + list(placed)
    ready_names = {g.name for g in groups if g.state is GroupState.READY}
    roles: dict[str, dict[str, int]] = {}
    desired_total = ready_total = 0
    for pool in deployment.spec.pools():
        role_layouts = [layout for layout in layouts if layout.role is pool.role]
        ready = sum(1 for g in groups if g.role is pool.role and g.name in ready_names)
        roles[pool.role.value] = {"desired": pool.replicas, "placed": len(role_layouts), "ready": ready}
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
    infeasible = "; ".join(f"{u['role']} {u['replica']}: {u['reason']}" for u in unplaced)
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
        "groups": groups_status,
        "unplaced": unplaced,
        "coldStart": {"strategy": deployment.spec.cold_start.strategy.value, "source": cold_start_source},
    }
