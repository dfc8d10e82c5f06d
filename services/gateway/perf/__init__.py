"""The cost model of a pass (PassCost) and the profile it starts from."""
