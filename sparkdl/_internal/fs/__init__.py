"""Files: storage on any fsspec URL (local, HDFS, S3, FTP, ...) and per-user private directories."""
