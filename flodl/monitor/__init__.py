"""Run monitoring: the on-disk record log, the alert lane and the live dashboard.

See docs/design.md §7.
"""
