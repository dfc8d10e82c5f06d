"""The step loops (`loop.Engine`) and their parts, one job each: the request table, intake, snapshots,
admission, draft calls (drafting ahead in overlap.py), passes and commit; the per-request state."""
