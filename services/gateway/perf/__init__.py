"""What the gateway knows of time: one record per engine iteration (IterationRecord), the cost model of
a pass fitted on those records (PassCost), and the profile it starts from."""
