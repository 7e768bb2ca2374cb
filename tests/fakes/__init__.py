"""Test fakes: stand-ins for systems the tests cannot reach, each named as a fake.

* :class:`tests.fakes.k8s_api.FakeKubernetesApiServer` -- a local HTTP server that speaks the
  Kubernetes REST paths and objects for JobSets and pods (not a cluster: nothing is scheduled),
  and refuses (422) a JobSet the API server would refuse: its CRD schema, its labels.
* ``tests/fakes/dataflow_launcher.py`` -- a stand-in interpreter for the Beam stage hook: records
  the Dataflow launch command and prints the job-id line Beam prints (nothing is submitted).
* :class:`tests.fakes.tpu_api.FakeTpuClient` -- answers the Cloud TPU API's
  ``list_accelerator_types`` from a fixed list (the TPU preflight's client).
"""
