"""The fair rule every shared table of the engine evicts by: the tenant holding the most gives way.

A table shared by tenants (namespaces) — the memory tier's bytes, the registered documents, the
live conversations, the live speculations — has one bound for all of them together. When an insert
by tenant ``t`` passes it, the table evicts from :func:`fair_victim`'s tenant: the one holding the
most, with ``t`` counted *after* its insert and ties going to ``t`` itself. Inside that tenant its
own order decides (the eviction policy, least recently used).

The bound this gives (with ``N`` the tenants holding entries, the inserting one included):

* a tenant never loses an entry to another tenant's insert while it holds no more than that
  tenant does; so a tenant filling the table evicts only its own entries once it holds the most;
* a tenant holding at most ``bound / N`` of a table (``bound``: the table's cap; for bytes, less
  the inserted entry's size) never loses an entry to another tenant.

A single tenant keeps the whole table (the rule is work-conserving): nothing is reserved for
tenants that hold nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

__all__ = ["fair_victim"]


def fair_victim(held: Mapping[Hashable, float], tenant: Hashable, adding: float = 0.0) -> Hashable:
    """The tenant to evict from when ``tenant`` adds ``adding`` to a full table.

    Args:
        held: what each tenant holds now (entries, or bytes), tenants holding nothing may be absent.
        tenant: the inserting tenant.
        adding: what its insert adds (counted in its holding: an insert never evicts another
            tenant that holds no more than the inserting one will).

    Returns:
        The tenant holding the most (``tenant`` counted with ``adding``; a tie goes to ``tenant``),
        among those holding something; ``tenant`` when nobody holds anything.
    """
    best, most = tenant, held.get(tenant, 0) + adding
    for other, amount in held.items():
        if other != tenant and amount > most:
            best, most = other, amount
    if best == tenant and not held.get(tenant, 0):  # the inserting tenant holds nothing to give
        others = {t: amount for t, amount in held.items() if t != tenant and amount > 0}
        if others:
            best = max(others, key=others.__getitem__)
    return best
