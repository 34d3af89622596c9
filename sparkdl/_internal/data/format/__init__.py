"""What a dataset on disk is: its manifest, read or built from the Parquet footers, and a Petastorm dataset's schema."""
