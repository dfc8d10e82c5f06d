"""Build the bundled demo model pair (target + distilled draft) and the workload prompt sets.

Not part of the installed package: run from the repository root as
`python -m training.build_demo_pair`. See models/README.md.
"""
