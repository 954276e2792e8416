"""Job kinds: what differs between a job that reads one dataset and one that reads a mixture.

A job's kind is chosen once, from the table in :mod:`.table` keyed by ``JobSpec.kind``;
admission, resident plans and stream plans are then asked of the kind's object
(:class:`.base.JobKind`), and no caller asks the spec which kind it is again.

To add a kind: its spec fields and a value of ``JobKindName`` in ``proto/jobs.py`` (with the
``JobSpec.kind`` that returns it), one class here taking :class:`.base.KindParts`, and one
row in :data:`.table.KINDS`.
"""
