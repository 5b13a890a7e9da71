output "cluster_name" {
  description = "The EKS cluster (aws eks update-kubeconfig --name ...)."
  value       = module.eks.cluster_name
}

output "servelm_service" {
  description = "The Service exposing servelm: kubectl -n servelm get svc <this> for the load balancer's address."
  value       = strcontains(helm_release.servelm.name, "servelm") ? helm_release.servelm.name : "${helm_release.servelm.name}-servelm"
}
