"""Constants of upstream's Spark estimators (``horovod.spark.common.constants``).

``ARRAY`` / ``CUSTOM_SPARSE`` / ``NOCHANGE`` are the ``intermediate_format`` values of a column's metadata (see
:mod:`horovod.spark.common.data`: this implementation writes vectors as ``ARRAY`` and never uses
``CUSTOM_SPARSE``).  The Petastorm, buffer and printing constants are kept for code that imports them; nothing
here reads them (no Petastorm).
"""

PETASTORM_HDFS_DRIVER = "libhdfs"
METRIC_PRINT_FREQUENCY = 1000  # steps between metric prints in verbose mode

ARRAY = "array"
CUSTOM_SPARSE = "custom_sparse_format"
NOCHANGE = "nochange"

MIXED_SPARSE_DENSE_VECTOR = "mixed_sparse_dense_vector"
SPARSE_VECTOR = "sparse_vector"
DENSE_VECTOR = "dense_vector"

TOTAL_BUFFER_MEMORY_CAP = 4  # GB
ONE_GB = 1073741824
