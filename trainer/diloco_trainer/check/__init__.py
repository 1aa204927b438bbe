"""`diloco check CONFIG`: a job checked before anything starts (and by `diloco run` first).

document.py reads the file (a DiLoCoJob or its spec; every refusal names the file or field),
checks.py runs the checks of the job's schedule, data, memory and model, findings.py and
memory_estimate.py are the pure rules and estimates they use, build.py calls a user's entrypoint
once.
"""

from diloco_trainer.check.checks import Report, check_job
from diloco_trainer.check.document import JobFile, load_job_file

__all__ = ["JobFile", "Report", "check_job", "load_job_file"]
