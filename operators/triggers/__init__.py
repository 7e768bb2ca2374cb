"""Airflow triggers: what a deferred task waits on in the triggerer, without a worker slot.

* :class:`~operators.triggers.jobset.JobSetTrigger` follows a JobSet on GKE to its end.
* :mod:`operators.triggers.lease` keeps the step's RUNNING lease alive meanwhile.
"""
