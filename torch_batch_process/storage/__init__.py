"""Storage: one small interface over local folders and object stores, the job lock, the stored names."""
