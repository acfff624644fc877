from torchtitan.config.job_config import JobConfig
from torchtitan.config.loading import ConfigError, ConfigSources, load_config

__all__ = ["ConfigError", "ConfigSources", "JobConfig", "load_config"]
