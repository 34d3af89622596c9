"""``write_dataset``: a DataFrame written as Parquet with its manifest, to a path or to the cache."""
