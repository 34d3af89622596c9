"""A sample's columns into arrays: per-sample functions on workers, images (Pillow, simplejpeg, nvJPEG, DALI), Petastorm's transforms and codecs."""
