"""Waits that can never end: workers blocked in different collectives (docs/bad_input.md).

A worker in a barrier makes no other call until it is released, so when the active workers wait in
different barriers, or one waits in a barrier while a tensor it has not declared waits for it,
nothing can finish: the scheduler fails them all with one message naming who waits where.
"""


def find_deadlock(active, rank_of, barriers, declares, set_declares):
    """A message describing a wait that cannot end, or None.

    active: identities of the workers still in this epoch; rank_of: identity -> rank;
    barriers: name -> identities waiting in it; declares: (name, seq) -> {"specs": {identity: ...}};
    set_declares: (name, seq, set id) -> {"specs": ..., "members": identities}.
    """
    active = set(active)
    blocked = {i: name for name, group in barriers.items() for i in group if i in active}
    if not blocked:
        return None
    stuck = []
    for (name, _seq), pending in declares.items():
        if abandoned_only(pending):  # only ranks that refused the call declared it: nobody waits on it
            continue
        lacking = sorted(rank_of[i] for i in active - set(pending["specs"]) if i in blocked)
        if lacking:
            stuck.append(f"tensor {name!r} declared by ranks {sorted(rank_of[i] for i in pending['specs'])}")
    for (name, _seq, set_id), pending in set_declares.items():
        if abandoned_only(pending):
            continue
        if any(i in blocked for i in pending["members"] - set(pending["specs"])):
            stuck.append(f"tensor {name!r} of process set {set_id} declared by ranks "
                         f"{sorted(rank_of[i] for i in pending['specs'])}")
    if not stuck and not (active <= set(blocked) and len(set(blocked.values())) > 1):
        return None
    where = "; ".join(f"rank {rank_of[i]} in barrier {blocked[i]!r}" for i in sorted(blocked, key=rank_of.get))
    return ("the workers wait in different collectives and none can finish: " + "; ".join([where, *stuck]) +
            " (did a rank skip a collective after an error? every rank must make the same calls in the same order)")


def signature(barriers, declares, set_declares):
    """What changes whenever a worker makes progress: the grace period restarts on any change."""
    return (frozenset((n, frozenset(g)) for n, g in barriers.items()),
            frozenset((k, frozenset(p["specs"])) for k, p in declares.items()),
            frozenset((k, frozenset(p["specs"])) for k, p in set_declares.items()))


def abandoned_only(pending):
    """A declaration made only by ranks that refused the call (core/engine.py _abandon)."""
    return all("abandoned" in spec for spec in pending["specs"].values())
