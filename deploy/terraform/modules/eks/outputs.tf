output "cluster_name" {
  description = "The EKS cluster's name."
  value       = aws_eks_cluster.this.name
}

output "cluster_endpoint" {
  description = "The Kubernetes API endpoint."
  value       = aws_eks_cluster.this.endpoint
}

output "cluster_ca_certificate" {
  description = "The cluster CA, base64-encoded."
  value       = aws_eks_cluster.this.certificate_authority[0].data
}

output "vpc_id" {
  description = "The VPC the cluster runs in."
  value       = aws_vpc.this.id
}
