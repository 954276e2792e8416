"""Jobs by kind: admitting them (one class per kind, chosen once from a table), steering a
mixture, and each job's lifecycle state. What the server remembers of a job is in
:mod:`~..registry`."""
