"""TaskFlow decorators (``@task.sky``), registered in the provider info as ``task-decorators``."""
