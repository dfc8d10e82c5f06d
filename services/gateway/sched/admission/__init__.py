"""SLOs-Serve's admission: PB* (budget.py, budget_model.py, over the replica's cost model, cost.py),
the planning DP (dp.py) and the scheduler's proposal stage that uses them (slo.py, `--admission slo`)."""
