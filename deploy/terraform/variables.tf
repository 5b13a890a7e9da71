variable "region" {
  description = "AWS region of the cluster."
  type        = string
  default     = "us-east-1"
}

variable "name" {
  description = "Cluster and release name."
  type        = string
  default     = "servelm"
}

variable "endpoint_public_access_cidrs" {
  description = "CIDRs that may reach the Kubernetes API (where terraform and CI run); empty: private endpoint only."
  type        = list(string)
  default     = []
}

variable "cpu_instance_types" {
  description = "CPU node pool instance types."
  type        = list(string)
  default     = ["m7i.2xlarge"]
}

variable "cpu_node_count" {
  description = "CPU node pool: desired, min, max."
  type        = object({ desired = number, min = number, max = number })
  default     = { desired = 2, min = 2, max = 6 }
}

variable "gpu_instance_types" {
  description = "GPU node pool instance types."
  type        = list(string)
  default     = ["g6.xlarge"]
}

variable "gpu_node_count" {
  description = "GPU node pool: desired, min, max (min 0: scale to zero)."
  type        = object({ desired = number, min = number, max = number })
  default     = { desired = 1, min = 0, max = 4 }
}

variable "image" {
  description = "servelm image repository (the CUDA image when gpus_per_replica > 0)."
  type        = string
  default     = "ghcr.io/example/servelm-cuda"
}

variable "image_digest" {
  description = "Image digest (sha256:...) to pin; CI passes the one it pushed."
  type        = string
  default     = ""
}

variable "image_tag" {
  description = "Image tag, used when image_digest is empty."
  type        = string
  default     = "0.1.0"
}

variable "replicas" {
  description = "servelm replicas: min and max for KEDA."
  type        = object({ min = number, max = number })
  default     = { min = 2, max = 8 }
}

variable "gpus_per_replica" {
  description = "nvidia.com/gpu per servelm pod (0: CPU pods)."
  type        = number
  default     = 1
}

variable "enable_keda" {
  description = "Render the KEDA ScaledObject (KEDA and Prometheus must be installed in the cluster)."
  type        = bool
  default     = true
}

variable "prometheus_address" {
  description = "Prometheus that KEDA queries for servelm:num_requests_waiting."
  type        = string
  default     = "http://prometheus-operated.monitoring.svc:9090"
}

variable "expose_cidrs" {
  description = "Client CIDRs allowed through the load balancer that exposes servelm."
  type        = list(string)
  default     = ["10.0.0.0/8"]
}

variable "tags" {
  description = "Tags applied to every AWS resource."
  type        = map(string)
  default     = { app = "servelm" }
}
