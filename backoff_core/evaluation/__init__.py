"""Router evaluation: teacher-forced curves, generation runs, the report and its plots."""
