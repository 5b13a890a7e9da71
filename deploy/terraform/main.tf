# servelm on AWS: an EKS cluster with a CPU and a GPU node pool (modules/eks), the servelm chart installed
# into it with Helm, exposed through an internal Network Load Balancer.
provider "aws" {
  region = var.region
  default_tags {
    tags = var.tags
  }
}

module "eks" {
  source                       = "./modules/eks"
  name                         = var.name
  endpoint_public_access_cidrs = var.endpoint_public_access_cidrs
  cpu_instance_types           = var.cpu_instance_types
  cpu_node_count               = var.cpu_node_count
  gpu_instance_types           = var.gpu_instance_types
  gpu_node_count               = var.gpu_node_count
  tags                         = var.tags
}

data "aws_eks_cluster_auth" "this" {
  name = module.eks.cluster_name
}

provider "helm" {
  kubernetes {
    host                   = module.eks.cluster_endpoint
    cluster_ca_certificate = base64decode(module.eks.cluster_ca_certificate)
    token                  = data.aws_eks_cluster_auth.this.token
  }
}

# NVIDIA's device plugin advertises nvidia.com/gpu on the GPU nodes (the NVIDIA AMI has the driver)
resource "helm_release" "nvidia_device_plugin" {
  name             = "nvidia-device-plugin"
  repository       = "https://nvidia.github.io/k8s-device-plugin"
  chart            = "nvidia-device-plugin"
  version          = "0.17.1"
  namespace        = "kube-system"
  create_namespace = false
  values = [yamlencode({
    nodeSelector = { "nvidia.com/gpu.present" = "true" }
    tolerations  = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
  })]
}

resource "helm_release" "servelm" {
  name             = var.name
  chart            = "${path.module}/../helm/servelm"
  namespace        = "servelm"
  create_namespace = true
  wait             = true
  timeout          = 1200 # first start pulls a multi-GB image and loads the model
  values = [yamlencode({
    image = {
      repository = var.image
      tag        = var.image_tag
      digest     = var.image_digest
    }
    gpu = { count = var.gpus_per_replica }
    service = {
      type = "LoadBalancer"
      annotations = {
        "service.beta.kubernetes.io/aws-load-balancer-type"   = "nlb"
        "service.beta.kubernetes.io/aws-load-balancer-scheme" = "internal"
      }
    }
    networkPolicy = { from = [for c in var.expose_cidrs : { ipBlock = { cidr = c } }] }
    autoscaling = {
      minReplicas = var.replicas.min
      maxReplicas = var.replicas.max
      keda        = { enabled = var.enable_keda, prometheusAddress = var.prometheus_address }
    }
    serviceMonitor = { enabled = var.enable_keda }
    topologySpreadConstraints = [{
      maxSkew           = 1
      topologyKey       = "topology.kubernetes.io/zone"
      whenUnsatisfiable = "ScheduleAnyway"
      labelSelector     = { matchLabels = { "app.kubernetes.io/name" = "servelm" } }
    }]
  })]
  depends_on = [helm_release.nvidia_device_plugin]
}
