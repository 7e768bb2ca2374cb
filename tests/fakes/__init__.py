"""Test fakes: stand-ins for systems the tests cannot reach, each named as a fake.

* :class:`tests.fakes.k8s_api.FakeKubernetesApiServer` -- a local HTTP server that speaks the
  Kubernetes REST paths and objects for JobSets and pods (not a cluster: nothing is scheduled).
"""
