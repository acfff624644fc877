"""The run report (scripts/report.py): a run folder's metrics, timelines and plan read robustly (run_folder.py),
drawn with matplotlib (figures.py) into one self-contained HTML page (html.py) plus a PNG per plot and the ranks'
merged Chrome trace (output.py)."""
