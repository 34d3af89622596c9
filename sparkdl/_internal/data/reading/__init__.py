"""One rank's rows: its share of each epoch, the row groups read into batches (pyarrow or Petastorm), ahead in a thread, resharded on resume."""
