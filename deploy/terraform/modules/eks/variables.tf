variable "name" {
  description = "Cluster name; also the prefix of every resource this module creates."
  type        = string
  default     = "servelm"
}

variable "kubernetes_version" {
  description = "EKS Kubernetes version (the chart needs >= 1.25)."
  type        = string
  default     = "1.33"
}

variable "vpc_cidr" {
  description = "CIDR of the VPC the module creates (two private and two public subnets are carved from it)."
  type        = string
  default     = "10.40.0.0/16"
}

variable "zone_suffixes" {
  description = "Availability zones of the region to use, by their letter (a private and a public subnet in each)."
  type        = list(string)
  default     = ["a", "b"]
}

variable "endpoint_public_access_cidrs" {
  description = "CIDRs allowed to reach the public API endpoint; empty disables the public endpoint (private only)."
  type        = list(string)
  default     = []
}

variable "cpu_instance_types" {
  description = "Instance types of the CPU node pool (API processes, CPU models, system pods)."
  type        = list(string)
  default     = ["m7i.2xlarge"]
}

variable "cpu_node_count" {
  description = "CPU node pool size: desired, min and max (the cluster autoscaler or Karpenter moves within)."
  type        = object({ desired = number, min = number, max = number })
  default     = { desired = 2, min = 2, max = 6 }
}

variable "gpu_instance_types" {
  description = "Instance types of the GPU node pool (one NVIDIA GPU each by default)."
  type        = list(string)
  default     = ["g6.xlarge"]
}

variable "gpu_node_count" {
  description = "GPU node pool size: desired, min and max; min 0 lets the pool scale to zero."
  type        = object({ desired = number, min = number, max = number })
  default     = { desired = 1, min = 0, max = 4 }
}

variable "node_disk_gb" {
  description = "Root volume size of every node in GiB (images with torch are several GB)."
  type        = number
  default     = 100
}

variable "tags" {
  description = "Tags applied to every resource."
  type        = map(string)
  default     = {}
}
