"""The read path above the store: the one place a stream's source chain is built (stored
data, transforms, collation) and the assembly of its batches. The contract every source
meets is :mod:`~..source`."""
