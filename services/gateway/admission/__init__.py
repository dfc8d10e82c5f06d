"""SLOs-Serve's admission: the roofline (roofline.py), PB* (budget.py, budget_model.py), the planning
DP (dp.py) and the scheduler's proposal stage that uses them (slo.py, `--admission slo`)."""
