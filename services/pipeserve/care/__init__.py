"""Process care: what keeps a stage process observable, and its group stoppable.

The side port (/livez, /readyz, /metrics: health), the wedge detector (wedge),
and the local launcher of a group's processes (launcher).
"""
