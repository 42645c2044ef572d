"""What a run leaves for its reader, built from its finished tasks and its journal: the
results table and plots (report), the matched-KL table (matched_kl), the aggregate over a
sweep's runs (aggregate), and where the time went, with the durations it teaches the next
run's ETA (timeline, timeline_plot). Parent side and torch-free; below `pita.experiment`,
which calls it at a run's end."""
